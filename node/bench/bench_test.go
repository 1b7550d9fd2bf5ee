package bench

import (
	"strings"
	"testing"
)

// TestPrintRatios: the table gives meshnode's ratios to a reference
// engine at the same stream count, the floor's share where there is a
// floor, and says from which position the decode steps ran.
func TestPrintRatios(t *testing.T) {
	var b strings.Builder
	Print(&b, []Row{
		{Engine: "meshnode", Streams: 1, PrefillTPS: 200, DecodeTPS: 60, FloorTPS: 86, Prompt: 512, Decode: 256},
		{Engine: "ollama", Streams: 1, PrefillTPS: 100, DecodeTPS: 40, FloorTPS: 100, Prompt: 512, Decode: 256},
		{Engine: "meshnode", Streams: 8, PrefillTPS: 300, DecodeTPS: 240, Prompt: 512, Decode: 256},
	})
	lines := strings.Split(b.String(), "\n")
	var one, eight string
	for _, l := range lines {
		switch f := strings.Fields(l); {
		case len(f) > 1 && f[0] == "meshnode" && f[1] == "1":
			one = l
		case len(f) > 1 && f[0] == "meshnode" && f[1] == "8":
			eight = l
		}
	}
	// 60 / 86 = 0.6977: three places, so that it does not read as 0.70.
	if !strings.Contains(one, "2.00 / 1.50") || !strings.HasSuffix(strings.TrimSpace(one), "0.698") {
		t.Errorf("one stream: want ratios 2.00 / 1.50 and floor share 0.698:\n%s", b.String())
	}
	if strings.Contains(eight, "/") || strings.HasSuffix(strings.TrimSpace(eight), "0.698") {
		t.Errorf("eight streams have no reference and no floor:\n%s", b.String())
	}
	if !strings.Contains(b.String(), "256 steps a sequence from position 512") {
		t.Errorf("the table does not say where decode ran:\n%s", b.String())
	}
}
