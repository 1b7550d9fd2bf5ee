package membership

import (
	"slices"
	"testing"
)

func TestOffers(t *testing.T) {
	cases := []struct {
		name   string
		meta   Meta
		engine string
		want   bool
	}{
		{"lists it", Meta{Engine: "ggml", Engines: []string{"ggml", "mlx"}}, "mlx", true},
		{"lists others", Meta{Engine: "ggml", Engines: []string{"ggml"}}, "mlx", false},
		{"the list wins over Engine", Meta{Engine: "mlx", Engines: []string{"ggml"}}, "mlx", false},
		{"no list: Engine", Meta{Engine: "ggml"}, "ggml", true},
		{"no list: Engine only", Meta{Engine: "ggml"}, "mlx", false},
		{"nothing announced: ggml", Meta{}, "ggml", true},
		{"nothing announced: not mlx", Meta{}, "mlx", false},
	}
	for _, c := range cases {
		if got := c.meta.Offers(c.engine); got != c.want {
			t.Errorf("%s: Offers(%q) = %v, want %v", c.name, c.engine, got, c.want)
		}
	}
	for ref, want := range map[ModelRef]string{{}: "ggml", {Engine: "ggml"}: "ggml", {Engine: "mlx"}: "mlx"} {
		if got := ref.NeedsEngine(); got != want {
			t.Errorf("%+v.NeedsEngine() = %q, want %q", ref, got, want)
		}
	}
}

// TestEnginesOnTheWire: the engines a node offers and the engine a model
// needs survive gossip, in the full meta and in push-pull state; a node
// that sends neither (an older one) decodes as ggml.
func TestEnginesOnTheWire(t *testing.T) {
	m := sampleMeta("p")
	m.Engine, m.Engines = "mlx", []string{"ggml", "mlx"}
	m.Models[0].Engine = "mlx"
	check := func(how string, got Meta) {
		t.Helper()
		if got.Engine != "mlx" || !slices.Equal(got.Engines, m.Engines) || len(got.Models) != 1 || got.Models[0].Engine != "mlx" {
			t.Errorf("%s: engine %q engines %v models %+v", how, got.Engine, got.Engines, got.Models)
		}
	}
	b, err := encodeNodeMeta(m, false, 512)
	if err != nil || b[0] != tagFull {
		t.Fatalf("encode: %q %v", b, err)
	}
	nm, err := decodeNodeMeta(b)
	if err != nil {
		t.Fatal(err)
	}
	check("full meta", nm.meta)
	st, err := encodeState("p", m)
	if err != nil {
		t.Fatal(err)
	}
	_, got, _, err := decodeState(st)
	if err != nil {
		t.Fatal(err)
	}
	check("push-pull state", got)

	old, err := decodeNodeMeta([]byte(`F{"n":"old","e":"ggml","m":[{"i":"abc","f":true}],"v":1}`))
	if err != nil {
		t.Fatal(err)
	}
	if !old.meta.Offers("ggml") || old.meta.Offers("mlx") || old.meta.Models[0].NeedsEngine() != "ggml" {
		t.Errorf("an older node's meta %+v", old.meta)
	}
}
