package bench

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestMeshNetnsDelay runs a 2-stage mesh in network namespaces with a
// delay between them and checks that the delay applied to the stages'
// traffic: every decode step crosses the hop to stage 2 and the token
// comes back to stage 1, so no step can take less than twice the delay,
// and one stream's decode rate is at most 1/(2·delay). Undelayed,
// stories260K decodes far faster than that.
func TestMeshNetnsDelay(t *testing.T) {
	if testing.Short() {
		t.Skip("starts meshnode processes")
	}
	if runtime.GOOS != "linux" || os.Geteuid() != 0 {
		t.Skip("needs root on Linux to create network namespaces")
	}
	for _, tool := range []string{"ip", "nft"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s: %v", tool, err)
		}
	}
	if _, err := os.Stat(meshTestModel); err != nil {
		t.Skipf("no test model: %v", err)
	}
	bin := buildMeshnode(t)
	for _, tc := range []struct {
		name   string
		delay  time.Duration
		stages int
	}{
		{"2 stages, 25ms", 25 * time.Millisecond, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			var log bytes.Buffer
			rows, err := RunMesh(ctx, MeshConfig{
				Model: meshTestModel, Binary: bin, Stages: []int{tc.stages}, Streams: []int{1},
				PromptTokens: 16, DecodeTokens: 16, Threads: 1, ReadyTimeout: 2 * time.Minute,
				Netns: true, SkipLoopback: true, NetnsDelay: tc.delay,
			}, &log)
			t.Logf("log:\n%s", log.String())
			if err != nil {
				t.Fatal(err)
			}
			if out, _ := exec.Command("ip", "netns", "list").Output(); strings.Contains(string(out), netnsPrefix) {
				t.Errorf("namespaces left behind: %s", out)
			}
			if len(rows) != 1 || rows[0].Stages != tc.stages || rows[0].Network != "netns+"+tc.delay.String() {
				t.Fatalf("rows %+v, want one netns+%v row of %d stages", rows, tc.delay, tc.stages)
			}
			limit := 1 / (2 * tc.delay.Seconds())
			if got := rows[0].DecodeTPS; !(got > 0) || got > limit*1.05 {
				t.Errorf("decode %.1f tok/s through a %v hop; the delay allows at most %.1f: the delay did not apply", got, tc.delay, limit)
			}
			if !strings.Contains(log.String(), "netem qdisc on each node's veth") && !strings.Contains(log.String(), "delay relay: ") {
				t.Error("the log does not say how the delay was made")
			}
		})
	}
}
