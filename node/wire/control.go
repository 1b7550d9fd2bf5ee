package wire

import (
	"errors"
	"fmt"
	"math"

	"github.com/meshnode/meshnode/node/sample"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// Op is a sequence control operation.
type Op uint8

// Sequence control operations, mirroring stage.Engine's Open, Trim and
// Release.
const (
	OpOpen Op = iota + 1
	OpTrim
	OpRelease
)

func (o Op) String() string {
	switch o {
	case OpOpen:
		return "open"
	case OpTrim:
		return "trim"
	case OpRelease:
		return "release"
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// Control is one sequence control operation.
type Control struct {
	Op  Op
	Seq stage.SeqID
	// Pos is the first position that OpTrim drops; zero for other ops.
	Pos int32
	// Sampling configures the last stage's sampler; OpOpen only, nil means
	// greedy.
	Sampling *Sampling
	// History holds the tokens the sequence already has at positions
	// [0, len), for the last stage's repetition penalties; OpOpen only.
	History []int32
}

// Sampling configures how the last stage samples one sequence.
type Sampling struct {
	Temperature float32 // 0 is greedy
	TopK        int     // 0 keeps all
	TopP        float32 // 0 or 1 keeps all
	MinP        float32 // 0 keeps all
	Seed        uint64

	RepeatPenalty    float32 // 0 or 1 is off
	RepeatLastN      int     // 0 is the default window, -1 the whole history
	FrequencyPenalty float32 // [-2, 2]
	PresencePenalty  float32 // [-2, 2]

	Logprobs    bool // return each token's log-probability
	TopLogprobs int  // with this many alternatives, [0, sample.MaxTopLogprobs]

	JSON       bool   // keep the output one JSON object
	JSONFrom   int    // where the output starts in the history
	JSONSchema string // the object's JSON Schema; empty: any object
}

// MaxSchemaBytes bounds Sampling.JSONSchema.
const MaxSchemaBytes = 64 << 10

func (s *Sampling) check(maxVocab int) error {
	finite := func(v float32) bool { return !math.IsNaN(float64(v)) && !math.IsInf(float64(v), 0) }
	switch {
	case !finite(s.Temperature) || s.Temperature < 0:
		return fmt.Errorf("sampling temperature %v is not a finite value >= 0", s.Temperature)
	case s.TopK < 0 || s.TopK > maxVocab:
		return fmt.Errorf("sampling top_k %d outside [0,%d]", s.TopK, maxVocab)
	case !finite(s.TopP) || s.TopP < 0 || s.TopP > 1:
		return fmt.Errorf("sampling top_p %v outside [0,1]", s.TopP)
	case !finite(s.MinP) || s.MinP < 0 || s.MinP > 1:
		return fmt.Errorf("sampling min_p %v outside [0,1]", s.MinP)
	case !finite(s.RepeatPenalty) || s.RepeatPenalty < 0:
		return fmt.Errorf("sampling repeat_penalty %v is not a finite value >= 0", s.RepeatPenalty)
	case s.RepeatLastN < -1 || s.RepeatLastN > math.MaxInt32:
		return fmt.Errorf("sampling repeat_last_n %d outside [-1,%d]", s.RepeatLastN, math.MaxInt32)
	case !finite(s.FrequencyPenalty) || s.FrequencyPenalty < -2 || s.FrequencyPenalty > 2:
		return fmt.Errorf("sampling frequency_penalty %v outside [-2,2]", s.FrequencyPenalty)
	case !finite(s.PresencePenalty) || s.PresencePenalty < -2 || s.PresencePenalty > 2:
		return fmt.Errorf("sampling presence_penalty %v outside [-2,2]", s.PresencePenalty)
	case s.TopLogprobs < 0 || s.TopLogprobs > sample.MaxTopLogprobs:
		return fmt.Errorf("sampling top_logprobs %d outside [0,%d]", s.TopLogprobs, sample.MaxTopLogprobs)
	case s.TopLogprobs > 0 && !s.Logprobs:
		return fmt.Errorf("sampling top_logprobs %d without logprobs", s.TopLogprobs)
	case s.JSONFrom < 0 || s.JSONFrom > math.MaxInt32:
		return fmt.Errorf("sampling json_from %d outside [0,%d]", s.JSONFrom, math.MaxInt32)
	case s.JSONFrom != 0 && !s.JSON:
		return fmt.Errorf("sampling json_from %d without json_object", s.JSONFrom)
	case len(s.JSONSchema) > MaxSchemaBytes:
		return fmt.Errorf("sampling json_schema of %d bytes, over the limit of %d", len(s.JSONSchema), MaxSchemaBytes)
	case s.JSONSchema != "" && !s.JSON:
		return fmt.Errorf("sampling json_schema without json_object")
	}
	return nil
}

// check validates the fields that each op uses and rejects the ones it
// does not, so that a confused peer is caught rather than half-obeyed.
func (c Control) check(lim Limits) error {
	maxVocab := lim.MaxVocab
	switch c.Op {
	case OpOpen, OpTrim, OpRelease:
	default:
		return fmt.Errorf("unknown control op %d", uint8(c.Op))
	}
	if c.Op == OpTrim && c.Pos < 0 {
		return fmt.Errorf("trim position %d is negative", c.Pos)
	}
	if c.Op != OpTrim && c.Pos != 0 {
		return fmt.Errorf("%s carries a position (%d); only trim does", c.Op, c.Pos)
	}
	if c.Sampling != nil {
		if c.Op != OpOpen {
			return fmt.Errorf("%s carries sampling parameters; only open does", c.Op)
		}
		if err := c.Sampling.check(maxVocab); err != nil {
			return err
		}
	}
	if len(c.History) != 0 {
		if c.Op != OpOpen {
			return fmt.Errorf("%s carries history; only open does", c.Op)
		}
		if len(c.History) > lim.MaxHistory {
			return fmt.Errorf("history of %d tokens, over the limit of %d", len(c.History), lim.MaxHistory)
		}
		if err := checkTokenIDs(c.History, maxVocab); err != nil {
			return fmt.Errorf("history: %w", err)
		}
	}
	return nil
}

var opToProto = map[Op]meshnodev1.SeqControl_Op{
	OpOpen:    meshnodev1.SeqControl_OP_OPEN,
	OpTrim:    meshnodev1.SeqControl_OP_TRIM,
	OpRelease: meshnodev1.SeqControl_OP_RELEASE,
}

// EncodeControl builds a control frame.
func EncodeControl(step uint64, c Control) (*meshnodev1.Frame, error) {
	if err := c.check(DefaultLimits()); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadBatch, err)
	}
	sc := &meshnodev1.SeqControl{
		Op:       opToProto[c.Op],
		SeqId:    uint64(c.Seq),
		Position: c.Pos,
		History:  tokensOrNil(c.History),
	}
	if s := c.Sampling; s != nil {
		sc.Sampling = &meshnodev1.Sampling{
			Temperature:      s.Temperature,
			TopK:             uint32(s.TopK),
			TopP:             s.TopP,
			MinP:             s.MinP,
			Seed:             s.Seed,
			RepeatPenalty:    s.RepeatPenalty,
			RepeatLastN:      int32(s.RepeatLastN),
			FrequencyPenalty: s.FrequencyPenalty,
			PresencePenalty:  s.PresencePenalty,
			Logprobs:         s.Logprobs,
			TopLogprobs:      uint32(s.TopLogprobs),
			JsonObject:       s.JSON,
			JsonFrom:         uint32(s.JSONFrom),
			JsonSchema:       s.JSONSchema,
		}
	}
	return &meshnodev1.Frame{
		Version: Version,
		Step:    step,
		Body:    &meshnodev1.Frame_Control{Control: sc},
	}, nil
}

// DecodeControl validates a control frame and returns its operation.
// History aliases the frame.
func DecodeControl(f *meshnodev1.Frame, lim Limits) (Control, error) {
	if err := checkFrame(f); err != nil {
		return Control{}, err
	}
	sc := f.GetControl()
	if sc == nil {
		return Control{}, wrongBody(f, "control")
	}
	lim = lim.resolved()
	c := Control{Seq: stage.SeqID(sc.GetSeqId()), Pos: sc.GetPosition(), History: tokensOrNil(sc.GetHistory())}
	switch sc.GetOp() {
	case meshnodev1.SeqControl_OP_OPEN:
		c.Op = OpOpen
	case meshnodev1.SeqControl_OP_TRIM:
		c.Op = OpTrim
	case meshnodev1.SeqControl_OP_RELEASE:
		c.Op = OpRelease
	default:
		return Control{}, frameErr(f, "control", fmt.Errorf("unknown op %d", int32(sc.GetOp())))
	}
	if s := sc.GetSampling(); s != nil {
		// Checked against MaxVocab before the int conversion, which could
		// wrap on 32-bit.
		if uint64(s.GetTopK()) > uint64(lim.MaxVocab) {
			return Control{}, frameErr(f, "control", fmt.Errorf("sampling top_k %d over the limit of %d", s.GetTopK(), lim.MaxVocab))
		}
		if s.GetTopLogprobs() > sample.MaxTopLogprobs {
			return Control{}, frameErr(f, "control", fmt.Errorf("sampling top_logprobs %d over the limit of %d", s.GetTopLogprobs(), sample.MaxTopLogprobs))
		}
		c.Sampling = &Sampling{
			Temperature:      s.GetTemperature(),
			TopK:             int(s.GetTopK()),
			TopP:             s.GetTopP(),
			MinP:             s.GetMinP(),
			Seed:             s.GetSeed(),
			RepeatPenalty:    s.GetRepeatPenalty(),
			RepeatLastN:      int(s.GetRepeatLastN()),
			FrequencyPenalty: s.GetFrequencyPenalty(),
			PresencePenalty:  s.GetPresencePenalty(),
			Logprobs:         s.GetLogprobs(),
			TopLogprobs:      int(s.GetTopLogprobs()),
			JSON:             s.GetJsonObject(),
			JSONFrom:         int(s.GetJsonFrom()),
			JSONSchema:       s.GetJsonSchema(),
		}
	}
	if err := c.check(lim); err != nil {
		return Control{}, frameErr(f, "control", err)
	}
	return c, nil
}

// MaxErrorMessage bounds the message of an error frame, in bytes: longer
// ones are cut when encoding and when decoding, so a peer cannot flood logs.
const MaxErrorMessage = 4096

// ErrUnavailable reports that a stage further down the pipeline could not be
// reached; it travels as CODE_UNAVAILABLE.
var ErrUnavailable = errors.New("wire: downstream stage unavailable")

// RemoteError is an error frame received from a peer. errors.Is matches it
// against the sentinel its code stands for (stage.ErrNoSlot,
// stage.ErrUnknownSeq, stage.ErrSeqExists, ErrVersion, ErrUnavailable), so
// callers handle local and remote failures alike. It never matches
// ErrBadFrame: that would mark the peer suspect for reporting that it was
// sent a bad frame.
type RemoteError struct {
	Step    uint64
	Code    meshnodev1.Error_Code
	Message string
	// Hop is the index in the pipeline's route of the stage the error is
	// about, or -1 when the frame does not say. DecodeError sets it;
	// EncodeError ignores it (EncodeHopError sets the frame's).
	Hop int
}

func (e *RemoteError) Error() string {
	return fmt.Sprintf("wire: peer failed step %d: %s: %s", e.Step, e.Code, e.Message)
}

// Is reports whether target is the sentinel for e.Code.
func (e *RemoteError) Is(target error) bool {
	if e.Code == meshnodev1.Error_CODE_BAD_FRAME {
		return false
	}
	s := codeSentinel[e.Code]
	return s != nil && target == s
}

var codeSentinel = map[meshnodev1.Error_Code]error{
	meshnodev1.Error_CODE_BAD_FRAME:           ErrBadFrame,
	meshnodev1.Error_CODE_UNSUPPORTED_VERSION: ErrVersion,
	meshnodev1.Error_CODE_UNKNOWN_SEQ:         stage.ErrUnknownSeq,
	meshnodev1.Error_CODE_NO_SLOT:             stage.ErrNoSlot,
	meshnodev1.Error_CODE_SEQ_EXISTS:          stage.ErrSeqExists,
	meshnodev1.Error_CODE_UNAVAILABLE:         ErrUnavailable,
}

// ErrorCode picks the wire code for err: a RemoteError keeps its own (so
// errors pass up the pipeline unchanged), a known sentinel gets its code,
// and anything else is reported as an engine failure.
func ErrorCode(err error) meshnodev1.Error_Code {
	var re *RemoteError
	if errors.As(err, &re) {
		return re.Code
	}
	// Version before bad frame: a version error wraps both.
	for _, c := range []meshnodev1.Error_Code{
		meshnodev1.Error_CODE_UNSUPPORTED_VERSION,
		meshnodev1.Error_CODE_BAD_FRAME,
		meshnodev1.Error_CODE_UNKNOWN_SEQ,
		meshnodev1.Error_CODE_NO_SLOT,
		meshnodev1.Error_CODE_SEQ_EXISTS,
		meshnodev1.Error_CODE_UNAVAILABLE,
	} {
		if errors.Is(err, codeSentinel[c]) {
			return c
		}
	}
	return meshnodev1.Error_CODE_ENGINE
}

// EncodeError builds the error frame that answers step with err.
func EncodeError(step uint64, err error) *meshnodev1.Frame {
	msg := "unknown error"
	if err != nil {
		msg = err.Error()
	}
	var re *RemoteError
	if errors.As(err, &re) {
		msg = re.Message // not re-prefixed at every hop
	}
	return &meshnodev1.Frame{
		Version: Version,
		Step:    step,
		Body: &meshnodev1.Frame_Error{Error: &meshnodev1.Error{
			Code:    ErrorCode(err),
			Message: truncate(msg, MaxErrorMessage),
		}},
	}
}

// EncodeHopError is EncodeError naming the hop, an index in the
// pipeline's route, that the error is about; hop < 0 names none.
func EncodeHopError(step uint64, hop int, err error) *meshnodev1.Frame {
	f := EncodeError(step, err)
	if hop >= 0 && hop < MaxRouteHops {
		h := uint32(hop)
		f.GetError().Hop = &h
	}
	return f
}

// Fatal reports whether an error with this code ends the stream it
// travels on (and so the pipeline): every code but those that only fail
// one step (ENGINE, NO_SLOT, SEQ_EXISTS).
func Fatal(code meshnodev1.Error_Code) bool {
	switch code {
	case meshnodev1.Error_CODE_ENGINE, meshnodev1.Error_CODE_NO_SLOT, meshnodev1.Error_CODE_SEQ_EXISTS:
		return false
	}
	return true
}

// DecodeError returns the error that an error frame reports. Codes newer
// than this code are kept as they are: an error is an error.
func DecodeError(f *meshnodev1.Frame) (*RemoteError, error) {
	if err := checkFrame(f); err != nil {
		return nil, err
	}
	e := f.GetError()
	if e == nil {
		return nil, wrongBody(f, "error")
	}
	hop := -1
	if e.Hop != nil {
		if e.GetHop() >= MaxRouteHops {
			return nil, fmt.Errorf("%w: step %d error names hop %d, beyond the %d a route may have", ErrBadFrame, f.GetStep(), e.GetHop(), MaxRouteHops)
		}
		hop = int(e.GetHop())
	}
	return &RemoteError{
		Step:    f.GetStep(),
		Code:    e.GetCode(),
		Message: truncate(e.GetMessage(), MaxErrorMessage),
		Hop:     hop,
	}, nil
}

// truncate cuts s to at most n bytes without splitting a UTF-8 sequence.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := n
	for i > 0 && s[i]&0xc0 == 0x80 { // step back over continuation bytes
		i--
	}
	return s[:i]
}

// EncodeLogits builds a logits frame (tests and debugging only) from rows
// rows of vocab f32 values.
func EncodeLogits(step uint64, rows, vocab int, logits []float32) (*meshnodev1.Frame, error) {
	if rows <= 0 || vocab <= 0 || uint64(rows) > math.MaxUint32 || uint64(vocab) > math.MaxUint32 {
		return nil, badBatch("logits shape [%d,%d]", rows, vocab)
	}
	if n, ok := payloadSize(uint64(rows), uint64(vocab), 1); !ok || uint64(len(logits)) != n {
		return nil, badBatch("%d logits do not fill [%d,%d]", len(logits), rows, vocab)
	}
	payload, err := stage.Encode(stage.F32, logits, nil)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadBatch, err)
	}
	return &meshnodev1.Frame{
		Version: Version,
		Step:    step,
		Body: &meshnodev1.Frame_Logits{Logits: &meshnodev1.Logits{
			Rows:    uint32(rows),
			Vocab:   uint32(vocab),
			Payload: payload,
		}},
	}, nil
}

// DecodeLogits validates a logits frame against lim and returns its values,
// row-major.
func DecodeLogits(f *meshnodev1.Frame, lim Limits) (logits []float32, rows, vocab int, err error) {
	if err := checkFrame(f); err != nil {
		return nil, 0, 0, err
	}
	l := f.GetLogits()
	if l == nil {
		return nil, 0, 0, wrongBody(f, "logits")
	}
	lim = lim.resolved()
	r, v := l.GetRows(), l.GetVocab()
	check := func() error {
		if r == 0 || v == 0 {
			return fmt.Errorf("shape [%d,%d] is not positive", r, v)
		}
		if uint64(r) > uint64(lim.MaxRows) || uint64(v) > uint64(lim.MaxVocab) {
			return fmt.Errorf("shape [%d,%d] over the limits [%d,%d]", r, v, lim.MaxRows, lim.MaxVocab)
		}
		want, ok := payloadSize(uint64(r), uint64(v), 4)
		if !ok || want > uint64(lim.MaxPayload) {
			return fmt.Errorf("shape [%d,%d] is over the payload limit of %d bytes", r, v, lim.MaxPayload)
		}
		if uint64(len(l.GetPayload())) != want {
			return fmt.Errorf("shape [%d,%d] needs %d payload bytes, got %d", r, v, want, len(l.GetPayload()))
		}
		return nil
	}
	if err := check(); err != nil {
		return nil, 0, 0, frameErr(f, "logits", err)
	}
	out, err := stage.Decode(stage.F32, l.GetPayload(), nil)
	if err != nil {
		return nil, 0, 0, frameErr(f, "logits", err)
	}
	return out, int(r), int(v), nil
}
