package openai

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"net/http"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"
)

// Config tunes the HTTP layer. The zero value is usable.
type Config struct {
	// APIKey, when set, is required as "Authorization: Bearer KEY" on /v1/*.
	APIKey string
	// MaxBodyBytes caps request bodies (413 beyond). Default 8 MiB.
	MaxBodyBytes int64
	// MaxTokensCap caps max_tokens, and is the limit when a request has
	// none (then also bounded by the room left in the context). Default 4096.
	MaxTokensCap int
	// WriteTimeout bounds each write to the client, so a client that stops
	// reading cannot hold a generation forever. Default 30 s. It is set per
	// write, so it also overrides http.Server.WriteTimeout for long streams.
	WriteTimeout time.Duration
	// Health, when set, makes GET /health answer 503 while it returns an error.
	Health func() error
	// Logger gets one line per request. Default: no logging.
	Logger *zap.Logger
}

const (
	defaultMaxBodyBytes = 8 << 20
	defaultMaxTokensCap = 4096
	defaultWriteTimeout = 30 * time.Second
)

type server struct {
	b       Backend
	cfg     Config
	log     *zap.Logger
	keyHash [sha256.Size]byte
	mux     *http.ServeMux
}

// NewHandler serves b through the OpenAI API.
func NewHandler(b Backend, cfg Config) http.Handler {
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = defaultMaxBodyBytes
	}
	if cfg.MaxTokensCap <= 0 {
		cfg.MaxTokensCap = defaultMaxTokensCap
	}
	if cfg.WriteTimeout <= 0 {
		cfg.WriteTimeout = defaultWriteTimeout
	}
	s := &server{b: b, cfg: cfg, log: cfg.Logger}
	if s.log == nil {
		s.log = zap.NewNop()
	}
	if cfg.APIKey != "" {
		// Hashing first makes the comparison constant-time in the key length too.
		s.keyHash = sha256.Sum256([]byte(cfg.APIKey))
	}

	// Methods are checked by hand: ServeMux's own 404/405 bodies are plain
	// text, and clients expect OpenAI's JSON errors.
	s.mux = http.NewServeMux()
	s.mux.HandleFunc("/health", s.only(s.health, http.MethodGet))
	s.mux.HandleFunc("/v1/models", s.only(s.listModels, http.MethodGet))
	// {id...}: model ids such as "org/name" contain slashes.
	s.mux.HandleFunc("/v1/models/{id...}", s.only(s.getModel, http.MethodGet))
	s.mux.HandleFunc("/v1/chat/completions", s.only(s.chatCompletions, http.MethodPost))
	s.mux.HandleFunc("/v1/completions", s.only(s.completions, http.MethodPost))
	s.mux.HandleFunc("/", s.notFound)
	return s
}

// reqInfo collects what the request log line reports; handlers fill it.
type reqInfo struct {
	id               string
	model            string
	stream           bool
	promptTokens     int
	completionTokens int
	finishReason     string
	err              string
}

type reqInfoKey struct{}

func infoOf(r *http.Request) *reqInfo {
	if li, ok := r.Context().Value(reqInfoKey{}).(*reqInfo); ok {
		return li
	}
	return &reqInfo{}
}

func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	li := &reqInfo{id: requestID(r.Header.Get("X-Request-Id"))}
	w.Header().Set("X-Request-Id", li.id)
	// MaxBytesReader gets the server's own writer so that it can mark the
	// connection for closing when the limit is hit.
	r.Body = http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes)
	r = r.WithContext(context.WithValue(r.Context(), reqInfoKey{}, li))
	sw := &statusWriter{ResponseWriter: w}

	abort := false
	defer func() {
		s.logRequest(r, sw, li, time.Since(start))
		if abort {
			// Headers are out: all that is left is to cut the connection.
			panic(http.ErrAbortHandler)
		}
	}()
	defer func() {
		v := recover()
		if v == nil {
			return
		}
		if v == http.ErrAbortHandler {
			abort = true
			return
		}
		s.log.Error("handler panic", zap.String("request_id", li.id), zap.Any("panic", v), zap.ByteString("stack", debug.Stack()))
		if sw.status == 0 {
			s.writeError(sw, r, internalError(fmt.Errorf("panic: %v", v)))
		} else {
			abort = true
		}
	}()

	if strings.HasPrefix(r.URL.Path, "/v1/") || r.URL.Path == "/v1" {
		if e := s.authorize(r); e != nil {
			sw.Header().Set("WWW-Authenticate", `Bearer realm="meshnode"`)
			s.writeError(sw, r, e)
			return
		}
	}
	s.mux.ServeHTTP(sw, r)
}

func (s *server) authorize(r *http.Request) *apiError {
	if s.cfg.APIKey == "" {
		return nil
	}
	h := r.Header.Get("Authorization")
	scheme, key, ok := strings.Cut(h, " ")
	if h == "" {
		return &apiError{status: http.StatusUnauthorized, typ: typeInvalidRequest, code: "invalid_api_key",
			message: "Missing API key: send it as 'Authorization: Bearer KEY'."}
	}
	got := sha256.Sum256([]byte(strings.TrimSpace(key)))
	if !ok || !strings.EqualFold(scheme, "Bearer") || subtle.ConstantTimeCompare(got[:], s.keyHash[:]) != 1 {
		return &apiError{status: http.StatusUnauthorized, typ: typeInvalidRequest, code: "invalid_api_key",
			message: "Incorrect API key provided."}
	}
	return nil
}

// requestID keeps a client's id when it is safe to echo and log.
func requestID(in string) string {
	if n := len(in); n > 0 && n <= 128 {
		ok := true
		for i := 0; i < n && ok; i++ {
			c := in[i]
			ok = c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
				c == '-' || c == '_' || c == '.' || c == ':'
		}
		if ok {
			return in
		}
	}
	return strings.ToLower(rand.Text())
}

func (s *server) logRequest(r *http.Request, sw *statusWriter, li *reqInfo, d time.Duration) {
	status := sw.status
	if status == 0 {
		// Nothing written: the client left before a response was ready.
		status = 499
	}
	fields := []zap.Field{
		zap.String("request_id", li.id),
		zap.String("method", r.Method),
		zap.String("path", r.URL.Path),
		zap.Int("status", status),
		zap.Duration("duration", d),
		zap.Int64("bytes", sw.bytes),
		zap.String("remote", r.RemoteAddr),
	}
	if li.model != "" {
		fields = append(fields,
			zap.String("model", li.model),
			zap.Bool("stream", li.stream),
			zap.Int("prompt_tokens", li.promptTokens),
			zap.Int("completion_tokens", li.completionTokens),
			zap.String("finish_reason", li.finishReason))
	}
	if li.err != "" {
		fields = append(fields, zap.String("error", li.err))
	}
	if status >= 500 {
		s.log.Warn("http request", fields...)
	} else {
		s.log.Info("http request", fields...)
	}
}

// statusWriter records what the log line needs. Unwrap lets
// http.ResponseController reach the server's writer (flush, deadlines).
type statusWriter struct {
	http.ResponseWriter
	status int
	bytes  int64
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	n, err := w.ResponseWriter.Write(p)
	w.bytes += int64(n)
	return n, err
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// only restricts a handler to one method (GET also allows HEAD).
func (s *server) only(h http.HandlerFunc, method string) http.HandlerFunc {
	allow := method
	if method == http.MethodGet {
		allow = "GET, HEAD"
	}
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Method == method || method == http.MethodGet && r.Method == http.MethodHead {
			h(w, r)
			return
		}
		w.Header().Set("Allow", allow)
		s.writeError(w, r, &apiError{
			status:  http.StatusMethodNotAllowed,
			message: fmt.Sprintf("Method %s is not allowed on %s; use %s.", r.Method, r.URL.Path, method),
			typ:     typeInvalidRequest,
			code:    "method_not_allowed",
		})
	}
}

func (s *server) notFound(w http.ResponseWriter, r *http.Request) {
	s.writeError(w, r, &apiError{
		status:  http.StatusNotFound,
		message: fmt.Sprintf("Invalid URL (%s %s).", r.Method, r.URL.Path),
		typ:     typeInvalidRequest,
		code:    "unknown_url",
	})
}

func (s *server) writeError(w http.ResponseWriter, r *http.Request, e *apiError) {
	infoOf(r).err = e.message
	if e.status == http.StatusTooManyRequests || e.status == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", "1")
	}
	s.writeJSON(w, e.status, e.body())
}

func (s *server) writeJSON(w http.ResponseWriter, status int, v any) {
	data, err := json.Marshal(v)
	if err != nil {
		// Only our own response types get here; they always marshal.
		status = http.StatusInternalServerError
		data = []byte(`{"error":{"message":"internal error: response encoding failed","type":"server_error","param":null,"code":null}}`)
	}
	data = append(data, '\n')
	_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(s.cfg.WriteTimeout))
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(data)))
	w.WriteHeader(status)
	_, _ = w.Write(data) // a failed write means the client is gone; nothing to do
}

func (s *server) health(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Health != nil {
		if err := s.cfg.Health(); err != nil {
			s.writeError(w, r, &apiError{
				status:  http.StatusServiceUnavailable,
				message: fmt.Sprintf("not ready: %v", err),
				typ:     typeServer,
				code:    "service_unavailable",
			})
			return
		}
	}
	s.writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// modelJSON is OpenAI's model object; context_length is an extension that
// OpenAI clients ignore and local tools read.
type modelJSON struct {
	ID            string `json:"id"`
	Object        string `json:"object"`
	Created       int64  `json:"created"`
	OwnedBy       string `json:"owned_by"`
	ContextLength int    `json:"context_length,omitempty"`
}

func toModelJSON(m ModelInfo) modelJSON {
	owner := m.OwnedBy
	if owner == "" {
		owner = "meshnode"
	}
	return modelJSON{ID: m.ID, Object: "model", Created: m.Created, OwnedBy: owner, ContextLength: m.ContextLength}
}

func (s *server) listModels(w http.ResponseWriter, r *http.Request) {
	models := s.b.Models()
	data := make([]modelJSON, 0, len(models))
	for _, m := range models {
		data = append(data, toModelJSON(m))
	}
	s.writeJSON(w, http.StatusOK, struct {
		Object string      `json:"object"`
		Data   []modelJSON `json:"data"`
	}{"list", data})
}

func (s *server) getModel(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if id == "" {
		s.notFound(w, r)
		return
	}
	m, ok := s.b.Model(id)
	if !ok {
		s.writeError(w, r, modelNotFound(id))
		return
	}
	s.writeJSON(w, http.StatusOK, toModelJSON(m.Info()))
}
