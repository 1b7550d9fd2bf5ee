package pipeline

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/stage"
)

func storiesVocab(t *testing.T) (func() (*sample.Vocab, error), *ggufstage.Tokenizer) {
	t.Helper()
	tok, err := ggufstage.LoadTokenizer(storiesPath)
	if err != nil {
		t.Fatal(err)
	}
	return func() (*sample.Vocab, error) {
		return sample.NewVocab(len(tok.Vocabulary().Values),
			func(id int32) (string, error) { return tok.Decode([]int32{id}) }, tok.IsSpecial, tok.IsEOG)
	}, tok
}

// TestPipelineJSON: across three stages, the last one keeps a sequence's
// output JSON, choosing exactly what a constrained sampler picks from the
// unsplit engine's logits; the sequence beside it in the batch is not
// constrained. A last stage without a vocabulary refuses such a sequence.
func TestPipelineJSON(t *testing.T) {
	for _, schema := range []string{"", `{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},"good":{"type":"boolean"}},"required":["age","good"]}`} {
		t.Run(map[bool]string{true: "object", false: "schema"}[schema == ""], func(t *testing.T) { testPipelineJSON(t, schema) })
	}
}

func testPipelineJSON(t *testing.T, schemaDoc string) {
	vocab, tok := storiesVocab(t)
	steps := twoSeqs.steps
	prompt := twoSeqs.prompts[0]

	// The reference: the unsplit engine's logits through a constrained
	// sampler, one token a step.
	e := openEngines(t, []int{0, 5}, engineOpts)[0]
	if err := e.Open(1); err != nil {
		t.Fatal(err)
	}
	v, err := vocab()
	if err != nil {
		t.Fatal(err)
	}
	params := greedy()
	params.JSON, params.JSONFrom = true, len(prompt) // the output starts after the prompt
	params.JSONSchema = schemaDoc
	schema, err := params.Schema()
	if err != nil {
		t.Fatal(err)
	}
	ref := sample.New(params)
	jc, err := sample.NewJSONConstraint(v, schema, nil)
	if err != nil {
		t.Fatal(err)
	}
	ref.Constrain(jc)
	var want []int32
	b := &stage.Batch{Outputs: []int{len(prompt) - 1}}
	for i, tok := range prompt {
		b.Seqs, b.Pos, b.Tokens = append(b.Seqs, 1), append(b.Pos, int32(i)), append(b.Tokens, tok)
	}
	history := slices.Clone(prompt)
	for range steps {
		out, err := e.Forward(context.Background(), b)
		if err != nil {
			t.Fatal(err)
		}
		next := ref.Sample(out.LogitsRow(0, e.Info().Vocab), history)
		out.Release()
		want, history = append(want, next), append(history, next)
		b = &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{int32(len(history) - 1)}, Tokens: []int32{next}, Outputs: []int{0}}
	}
	text, _ := tok.Decode(want)
	if j := sample.NewJSON(); !j.Feed([]byte(text)) || !strings.HasPrefix(text, "{") {
		t.Fatalf("the reference wrote %q", text)
	}
	if schema != nil && !sample.NewSchemaJSON(schema).Feed([]byte(text)) {
		t.Fatalf("the reference wrote %q, which the schema does not allow", text)
	}
	t.Logf("%q", text)

	m := newMesh(t, threeStages, engineOpts, stageOpts{}, stageOpts{}, stageOpts{vocab: vocab})
	p := m.pipeline(t, Config{WireDType: stage.F32})
	openAll(t, p, twoSeqs, func(i int) sample.Params {
		if i == 0 {
			return params
		}
		return greedy()
	})
	free := referenceTrace(t, twoSeqs) // the unconstrained neighbour's tokens
	b = twoSeqs.prefill()
	for step := range steps {
		picked, err := p.Forward(context.Background(), b)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		if picked.Tokens[0] != want[step] || picked.Tokens[1] != free.tokens[step][1] {
			t.Fatalf("step %d: tokens %v, want %d (JSON) and %d (free)", step, picked.Tokens, want[step], free.tokens[step][1])
		}
		b = twoSeqs.decode(step, picked.Tokens)
	}

	// Without a vocabulary the last stage cannot.
	bare := newMesh(t, threeStages, engineOpts)
	q := bare.pipeline(t, Config{})
	if err := q.Open(5, params, prompt); err == nil || !strings.Contains(err.Error(), "cannot keep output JSON") {
		t.Fatalf("opening a JSON sequence on a stage without a vocabulary: %v", err)
	}
}
