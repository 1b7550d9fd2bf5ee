package main

// Checks of deploy/: the configuration file format, the sample config, the
// systemd units (systemd-analyze verify), the launchd plists (plist
// structure; plutil -lint on macOS) and the Kubernetes manifests (schema
// validation offline with kubeconform, against the Kubernetes API schema
// that kubeconform's module ships as a test fixture).

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/yannh/kubeconform/pkg/validator"
	"sigs.k8s.io/yaml"
)

const deployDir = "../../deploy"

func writeFile(t *testing.T, name, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// testFlags is a command's flag set as newFlags and parse see it.
func testFlags(cmd string) (*flag.FlagSet, map[string]*string) {
	fs := newFlags(cmd+" [flags]", "test", "")
	fs.SetOutput(io.Discard)
	vals := map[string]*string{}
	for _, name := range []string{"config", "http", "model", "listen", "layers", "api-key"} {
		vals[name] = fs.String(name, "", "")
	}
	return fs, vals
}

func TestConfigFile(t *testing.T) {
	conf := writeFile(t, "meshnode.conf", `# a comment
; another
http = "0.0.0.0:9337"   # trailing comment
listen = ["/ip4/0.0.0.0/tcp/4001", '/ip6/::/tcp/4001']
API_KEY = 'a#b \n' # a literal keeps # and backslashes
layers = 0:4 # pinned

[serve]
model = "/models/a b.gguf"
[join]
layers = 8:16
`)
	t.Setenv("MESHNODE_HTTP", "")
	os.Unsetenv("MESHNODE_HTTP")

	fs, v := testFlags("serve")
	if err := parse(fs, []string{"--config", conf}); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"http": "0.0.0.0:9337", "listen": "/ip4/0.0.0.0/tcp/4001,/ip6/::/tcp/4001", "api-key": `a#b \n`,
		"layers": "0:4", "model": "/models/a b.gguf",
	}
	for k, w := range want {
		if *v[k] != w {
			t.Errorf("serve: %s = %q, want %q", k, *v[k], w)
		}
	}

	// A [join] key wins over the top for join; [serve] keys do not apply.
	fs, v = testFlags("join")
	if err := parse(fs, []string{"--config", conf}); err != nil {
		t.Fatal(err)
	}
	if *v["layers"] != "8:16" || *v["model"] != "" {
		t.Errorf("join: layers %q model %q", *v["layers"], *v["model"])
	}

	// The command line wins over the environment, which wins over the file.
	t.Setenv("MESHNODE_HTTP", "127.0.0.1:1")
	t.Setenv("MESHNODE_LAYERS", "1:2")
	fs, v = testFlags("serve")
	if err := parse(fs, []string{"--config", conf, "--layers", "3:4"}); err != nil {
		t.Fatal(err)
	}
	if *v["http"] != "127.0.0.1:1" || *v["layers"] != "3:4" || *v["model"] != "/models/a b.gguf" {
		t.Errorf("precedence: http %q layers %q model %q", *v["http"], *v["layers"], *v["model"])
	}
	os.Unsetenv("MESHNODE_HTTP")
	os.Unsetenv("MESHNODE_LAYERS")

	// MESHNODE_CONFIG names the file too.
	t.Setenv("MESHNODE_CONFIG", conf)
	fs, v = testFlags("serve")
	if err := parse(fs, nil); err != nil || *v["model"] != "/models/a b.gguf" {
		t.Errorf("MESHNODE_CONFIG: %v, model %q", err, *v["model"])
	}
	os.Unsetenv("MESHNODE_CONFIG")

	for name, c := range map[string]struct{ body, err string }{
		"unknown key":     {"modle = x\n", `unknown setting "modle"`},
		"unknown section": {"[serv]\nmodel = x\n", "unknown section [serv]"},
		"duplicate":       {"http = a:1\nhttp = b:2\n", "already set on line 1"},
		"no equals":       {"http 1.2.3.4:5\n", "want NAME = VALUE"},
		"open string":     {"http = \"1.2.3.4:5\n", "unterminated string"},
		"junk after":      {"http = \"a\" b\n", "unexpected"},
		"bad name":        {"ht tp = 1\n", "not a setting name"},
		"nested config":   {"config = other.conf\n", "cannot name another"},
	} {
		fs, _ := testFlags("serve")
		err := parse(fs, []string{"--config", writeFile(t, "bad.conf", c.body)})
		if err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("%s: got %v, want an error with %q", name, err, c.err)
		} else if !strings.Contains(err.Error(), "bad.conf:") {
			t.Errorf("%s: the error does not say where: %v", name, err)
		}
	}
	// status takes only what it knows.
	fs, v = testFlags("status")
	if err := parse(fs, []string{"--config", writeFile(t, "s.conf", "model = x\nflash-attn = true\napi-key = k\n")}); err != nil || *v["api-key"] != "k" {
		t.Errorf("status: %v, api-key %q", err, *v["api-key"])
	}
	if _, err := loadConfig(filepath.Join(t.TempDir(), "missing.conf")); err == nil {
		t.Error("a missing file loaded")
	}
}

// configLoads runs a node command with a config file up to the point where
// it would start: a --log-format that is rejected after the flags (and the
// file) were taken stops it there.
func configLoads(t *testing.T, cmd []string, conf string) {
	t.Helper()
	args := append(append([]string{}, cmd...), "--config", conf, "--log-format", "not-a-format")
	err := func() error {
		for _, c := range commands() {
			if c.name == args[0] {
				return c.run(t.Context(), args[1:])
			}
		}
		return errors.New("no command")
	}()
	if err == nil || !strings.Contains(err.Error(), "--log-format") {
		t.Errorf("meshnode %s with %s: %v (want only the planted --log-format error)", strings.Join(cmd, " "), conf, err)
	}
}

func TestDeployConfig(t *testing.T) {
	for _, k := range []string{"MESHNODE_API_KEY", "MESHNODE_API_KEY_FILE", "MESHNODE_CONFIG", "MESHNODE_HTTP"} {
		t.Setenv(k, "")
		os.Unsetenv(k)
	}
	conf := filepath.Join(deployDir, "meshnode.conf")
	configLoads(t, []string{"serve"}, conf)
	configLoads(t, []string{"join", "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWExample"}, conf)

	// status finds the node from the file's http setting.
	out, code, msg := statusRun(t.Context(), "--config", conf, "--api-key", "x", "--interval", "1s")
	_ = out
	if code != exitUnreachable || !strings.Contains(msg, "http://127.0.0.1:9337") && !strings.Contains(msg, "wants its API key") && !strings.Contains(msg, "does not look") {
		t.Logf("status --config: exit %d %q (a node may run on 9337 here)", code, msg)
	}
	if got := localURL("0.0.0.0:9337"); got != "http://127.0.0.1:9337" {
		t.Errorf("localURL: %s", got)
	}
	if got := localURL("[::]:9337"); got != "http://[::1]:9337" {
		t.Errorf("localURL v6: %s", got)
	}
}

// TestHelpExamples: every command's --help explains itself with examples.
func TestHelpExamples(t *testing.T) {
	for _, c := range commands() {
		out := captureOutput(t, func() { c.run(context.Background(), []string{"--help"}) })
		if !strings.Contains(out, "Examples:") || !strings.Contains(out, "meshnode "+c.name) {
			t.Errorf("meshnode %s --help has no examples:\n%s", c.name, out)
		}
	}
}

// captureOutput runs f with stdout and stderr going to a pipe.
func captureOutput(t *testing.T, f func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, stderr := os.Stdout, os.Stderr
	os.Stdout, os.Stderr = w, w
	done := make(chan string)
	go func() {
		b, _ := io.ReadAll(r)
		done <- string(b)
	}()
	defer func() {
		os.Stdout, os.Stderr = stdout, stderr
	}()
	f()
	w.Close()
	return <-done
}

// TestSystemdUnits runs systemd-analyze verify on the units (Debian's
// systemd package), with ExecStart pointed at a stand-in binary, and checks
// the hardening with systemd-analyze security --offline.
func TestSystemdUnits(t *testing.T) {
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze not installed (apt-get install -y systemd)")
	}
	dir := t.TempDir()
	stub := filepath.Join(dir, "meshnode")
	if err := os.WriteFile(stub, []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	units, _ := filepath.Glob(filepath.Join(deployDir, "systemd", "*.service"))
	if len(units) < 2 {
		t.Fatalf("units: %v", units)
	}
	for _, u := range units {
		body, err := os.ReadFile(u)
		if err != nil {
			t.Fatal(err)
		}
		text := string(body)
		for _, want := range []string{"ProtectSystem=strict", "NoNewPrivileges=yes", "StateDirectory=meshnode", "DynamicUser=yes", "--config /etc/meshnode/meshnode.conf"} {
			if !strings.Contains(text, want) {
				t.Errorf("%s lacks %s", u, want)
			}
		}
		p := filepath.Join(dir, filepath.Base(u))
		if err := os.WriteFile(p, []byte(strings.ReplaceAll(text, "/usr/local/bin/meshnode", stub)), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(sa, "verify", "--man=no", p).CombinedOutput()
		// verify exits 0 on unknown keys and bad values; it prints them.
		var complaints []string
		for _, line := range strings.Split(string(out), "\n") {
			if strings.Contains(line, filepath.Base(u)) {
				complaints = append(complaints, line)
			}
		}
		if err != nil || len(complaints) > 0 {
			t.Errorf("systemd-analyze verify %s: %v\n%s", filepath.Base(u), err, out)
		}
		sec, err := exec.Command(sa, "security", "--offline=true", "--no-pager", p).CombinedOutput()
		if err != nil {
			t.Logf("systemd-analyze security --offline unavailable (%v); hardening keys checked by name only", err)
			continue
		}
		m := regexp.MustCompile(`Overall exposure level for \S+: ([0-9.]+)`).FindSubmatch(sec)
		if m == nil {
			t.Errorf("no exposure level in:\n%s", sec)
			continue
		}
		if level, _ := strconv.ParseFloat(string(m[1]), 64); level > 2.0 {
			t.Errorf("%s: exposure %.1f, want at most 2.0:\n%s", filepath.Base(u), level, sec)
		}
	}
}

// plistNode is an element of a plist document.
type plistNode struct {
	XMLName  xml.Name
	Attrs    []xml.Attr  `xml:",any,attr"`
	Text     string      `xml:",chardata"`
	Children []plistNode `xml:",any"`
}

// checkPlistValue checks a value element of Apple's plist DTD.
func checkPlistValue(n plistNode, path string) error {
	switch n.XMLName.Local {
	case "string", "date", "data":
		if len(n.Children) > 0 {
			return fmt.Errorf("%s: <%s> holds elements", path, n.XMLName.Local)
		}
	case "integer":
		if _, err := strconv.ParseInt(strings.TrimSpace(n.Text), 10, 64); err != nil {
			return fmt.Errorf("%s: <integer>%s</integer>", path, n.Text)
		}
	case "real":
		if _, err := strconv.ParseFloat(strings.TrimSpace(n.Text), 64); err != nil {
			return fmt.Errorf("%s: <real>%s</real>", path, n.Text)
		}
	case "true", "false":
		if strings.TrimSpace(n.Text) != "" || len(n.Children) > 0 {
			return fmt.Errorf("%s: <%s/> must be empty", path, n.XMLName.Local)
		}
	case "array":
		for i, c := range n.Children {
			if err := checkPlistValue(c, fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
	case "dict":
		if len(n.Children)%2 != 0 {
			return fmt.Errorf("%s: <dict> with an odd number of elements", path)
		}
		seen := map[string]bool{}
		for i := 0; i < len(n.Children); i += 2 {
			k, v := n.Children[i], n.Children[i+1]
			if k.XMLName.Local != "key" {
				return fmt.Errorf("%s: <%s> where a <key> belongs", path, k.XMLName.Local)
			}
			if seen[k.Text] {
				return fmt.Errorf("%s: key %q twice", path, k.Text)
			}
			seen[k.Text] = true
			if err := checkPlistValue(v, path+"."+k.Text); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("%s: <%s> is not a plist value", path, n.XMLName.Local)
	}
	return nil
}

// dictGet returns a dict's value for a key.
func dictGet(d plistNode, key string) (plistNode, bool) {
	for i := 0; i+1 < len(d.Children); i += 2 {
		if d.Children[i].Text == key {
			return d.Children[i+1], true
		}
	}
	return plistNode{}, false
}

func TestLaunchdPlists(t *testing.T) {
	files, _ := filepath.Glob(filepath.Join(deployDir, "launchd", "*.plist"))
	if len(files) < 2 {
		t.Fatalf("plists: %v", files)
	}
	// launchd's keys and the value type each takes.
	types := map[string]string{
		"Label": "string", "ProgramArguments": "array", "EnvironmentVariables": "dict", "RunAtLoad": "bool",
		"KeepAlive": "bool|dict", "ThrottleInterval": "integer", "ExitTimeOut": "integer", "ProcessType": "string",
		"SoftResourceLimits": "dict", "StandardOutPath": "string", "StandardErrorPath": "string",
		"WorkingDirectory": "string", "UserName": "string",
	}
	for _, f := range files {
		body, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var doc plistNode
		dec := xml.NewDecoder(bytes.NewReader(body))
		dec.Strict = true
		if err := dec.Decode(&doc); err != nil {
			t.Errorf("%s is not well-formed XML: %v", f, err)
			continue
		}
		if !bytes.Contains(body, []byte(`<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN"`)) {
			t.Errorf("%s: no plist DOCTYPE", f)
		}
		if doc.XMLName.Local != "plist" || len(doc.Children) != 1 || doc.Children[0].XMLName.Local != "dict" {
			t.Errorf("%s: want <plist> holding one <dict>", f)
			continue
		}
		root := doc.Children[0]
		if err := checkPlistValue(root, filepath.Base(f)); err != nil {
			t.Error(err)
			continue
		}
		for i := 0; i+1 < len(root.Children); i += 2 {
			k, v := root.Children[i].Text, root.Children[i+1].XMLName.Local
			want, known := types[k]
			if !known {
				t.Errorf("%s: unexpected launchd key %s", f, k)
				continue
			}
			if v == "true" || v == "false" {
				v = "bool"
			}
			if !strings.Contains("|"+want+"|", "|"+v+"|") {
				t.Errorf("%s: %s is <%s>, want %s", f, k, v, want)
			}
		}
		label, _ := dictGet(root, "Label")
		if !strings.HasPrefix(label.Text, "com.meshnode.") || strings.TrimSuffix(filepath.Base(f), ".plist") != label.Text {
			t.Errorf("%s: Label %q does not match the file name", f, label.Text)
		}
		args, _ := dictGet(root, "ProgramArguments")
		var argv []string
		for _, a := range args.Children {
			if a.XMLName.Local != "string" {
				t.Errorf("%s: ProgramArguments holds <%s>", f, a.XMLName.Local)
			}
			argv = append(argv, a.Text)
		}
		if len(argv) < 2 || argv[0] != "/usr/local/bin/meshnode" || (argv[1] != "serve" && argv[1] != "join") {
			t.Errorf("%s: ProgramArguments %v", f, argv)
		} else {
			// The arguments are ones meshnode takes, with the sample config.
			cmd := []string{argv[1]}
			if argv[1] == "join" {
				cmd = append(cmd, argv[2])
			}
			configLoads(t, cmd, filepath.Join(deployDir, "meshnode.conf"))
		}
		if plutil, err := exec.LookPath("plutil"); err == nil {
			if out, err := exec.Command(plutil, "-lint", f).CombinedOutput(); err != nil {
				t.Errorf("plutil -lint %s: %v\n%s", f, err, out)
			}
		}
	}
}

// kubeSchemas writes kubeconform schemas for the kinds the manifests use,
// from the Kubernetes API definitions that kubeconform's module ships in
// its test fixtures (no network), made strict: unknown fields are errors.
func kubeSchemas(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/yannh/kubeconform").Output()
	if err != nil {
		t.Fatalf("finding kubeconform's module (go mod download): %v", err)
	}
	cache := filepath.Join(strings.TrimSpace(string(out)), "fixtures", "cache")
	entries, err := os.ReadDir(cache)
	if err != nil {
		t.Fatal(err)
	}
	var defs map[string]any
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(cache, e.Name()))
		if err != nil || !bytes.Contains(b, []byte(`"io.k8s.api.apps.v1.StatefulSet"`)) {
			continue
		}
		var doc struct {
			Definitions map[string]any `json:"definitions"`
		}
		if json.Unmarshal(b, &doc) == nil && doc.Definitions != nil {
			defs = doc.Definitions
			break
		}
	}
	if defs == nil {
		t.Fatalf("no Kubernetes API definitions in %s", cache)
	}
	for _, d := range defs {
		strict(d)
	}
	dir := t.TempDir()
	for file, def := range map[string]string{
		"statefulset-apps-v1.json": "io.k8s.api.apps.v1.StatefulSet",
		"service-v1.json":          "io.k8s.api.core.v1.Service",
		"configmap-v1.json":        "io.k8s.api.core.v1.ConfigMap",
		"secret-v1.json":           "io.k8s.api.core.v1.Secret",
	} {
		if defs[def] == nil {
			t.Fatalf("no definition %s", def)
		}
		b, _ := json.Marshal(map[string]any{"$ref": "#/definitions/" + def, "definitions": defs})
		if err := os.WriteFile(filepath.Join(dir, file), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// strict forbids properties a schema does not list, as kubeconform's
// -strict schemas do.
func strict(v any) {
	switch s := v.(type) {
	case map[string]any:
		_, preserve := s["x-kubernetes-preserve-unknown-fields"]
		if _, has := s["properties"]; has && !preserve {
			if _, set := s["additionalProperties"]; !set {
				s["additionalProperties"] = false
			}
		}
		for _, c := range s {
			strict(c)
		}
	case []any:
		for _, c := range s {
			strict(c)
		}
	}
}

func validateKube(t *testing.T, schemas, name string, manifest []byte) []validator.Result {
	t.Helper()
	v, err := validator.New([]string{schemas + "/{{ .ResourceKind }}{{ .KindSuffix }}.json"}, validator.Opts{Strict: true})
	if err != nil {
		t.Fatal(err)
	}
	return v.Validate(name, io.NopCloser(bytes.NewReader(manifest)))
}

func TestKubernetesManifests(t *testing.T) {
	path := filepath.Join(deployDir, "kubernetes", "meshnode.yaml")
	manifest, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	schemas := kubeSchemas(t)
	kinds := map[string]map[string]any{}
	for _, r := range validateKube(t, schemas, path, manifest) {
		switch r.Status {
		case validator.Valid:
		case validator.Empty:
			continue
		default:
			t.Errorf("%s: %v %v", path, r.Err, r.ValidationErrors)
			continue
		}
		var obj map[string]any
		if err := yaml.Unmarshal(r.Resource.Bytes, &obj); err != nil {
			t.Fatal(err)
		}
		meta, _ := obj["metadata"].(map[string]any)
		kinds[fmt.Sprintf("%s/%s", obj["kind"], meta["name"])] = obj
	}
	for _, want := range []string{"StatefulSet/meshnode", "Service/meshnode-mesh", "Service/meshnode", "ConfigMap/meshnode"} {
		if kinds[want] == nil {
			t.Errorf("no %s", want)
		}
	}

	// The schema bites: a misspelt field and a wrong type are caught.
	for name, bad := range map[string]string{
		"unknown field": strings.Replace(string(manifest), "serviceName: meshnode-mesh", "servicename: meshnode-mesh", 1),
		"wrong type":    strings.Replace(string(manifest), "replicas: 3", "replicas: three", 1),
	} {
		invalid := false
		for _, r := range validateKube(t, schemas, name, []byte(bad)) {
			invalid = invalid || r.Status == validator.Invalid
		}
		if !invalid {
			t.Errorf("%s: the broken manifest passed", name)
		}
	}

	// How the pods find each other.
	sts := kinds["StatefulSet/meshnode"]
	headless := kinds["Service/meshnode-mesh"]
	if sts == nil || headless == nil {
		return
	}
	get := func(v any, path ...any) any {
		for _, p := range path {
			switch k := p.(type) {
			case string:
				m, _ := v.(map[string]any)
				v = m[k]
			case int:
				l, _ := v.([]any)
				if k >= len(l) {
					return nil
				}
				v = l[k]
			}
		}
		return v
	}
	if get(sts, "spec", "serviceName") != "meshnode-mesh" || get(headless, "spec", "clusterIP") != "None" || get(headless, "spec", "publishNotReadyAddresses") != true {
		t.Error("the StatefulSet's pods are not named by a headless Service that publishes them before they are ready")
	}
	c := get(sts, "spec", "template", "spec", "containers", 0)
	if get(c, "readinessProbe", "httpGet", "path") != "/health" {
		t.Error("readiness is not /health")
	}
	if get(sts, "spec", "volumeClaimTemplates", 0, "metadata", "name") != "data" || get(c, "volumeMounts", 0, "mountPath") != "/data" {
		t.Error("no persistent data dir")
	}
	replicas := fmt.Sprint(get(sts, "spec", "replicas"))
	for _, e := range get(c, "env").([]any) {
		if get(e, "name") == "REPLICAS" && get(e, "value") != replicas {
			t.Errorf("REPLICAS=%v but replicas: %s", get(e, "value"), replicas)
		}
	}

	// The ConfigMap's config file is one meshnode takes, and its start
	// script does what it says.
	cm := kinds["ConfigMap/meshnode"]
	conf := writeFile(t, "meshnode.conf", get(cm, "data", "meshnode.conf").(string))
	for _, k := range []string{"MESHNODE_API_KEY", "MESHNODE_API_KEY_FILE", "MESHNODE_CONFIG"} {
		t.Setenv(k, "")
		os.Unsetenv(k)
	}
	configLoads(t, []string{"serve"}, conf)
	configLoads(t, []string{"join", "/dns4/meshnode-0.meshnode-mesh.default.svc.cluster.local/tcp/4001/p2p/12D3KooWExample"}, conf)
	checkStartScript(t, get(cm, "data", "start.sh").(string))
}

// checkStartScript runs the pods' start script with a stand-in meshnode:
// pod 2 joins pod 0 by DNS name with the key pod 0 gives; pod 0, alone,
// serves.
func checkStartScript(t *testing.T, script string) {
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("no sh")
	}
	dir := t.TempDir()
	scriptPath := filepath.Join(dir, "start.sh")
	os.WriteFile(scriptPath, []byte(script), 0o755)
	if out, err := exec.Command(sh, "-n", scriptPath).CombinedOutput(); err != nil {
		t.Fatalf("start.sh: %v\n%s", err, out)
	}
	const peer = "12D3KooWSeedSeedSeedSeedSeedSeedSeedSeedSeedSeedSeed"
	// The stand-in answers status for the hosts listed in $UP and prints
	// the command it would exec otherwise.
	stub := `#!/bin/sh
if [ "$1" = status ]; then
  for h in $UP; do
    case "$3" in *"//$h."*) echo "meshnode join /ip4/10.0.0.9/tcp/4001/p2p/` + peer + ` --mesh-key mk1_secret"; exit 1;; esac
  done
  echo "no meshnode answers" >&2; exit 3
fi
echo "EXEC $*"
`
	os.WriteFile(filepath.Join(dir, "meshnode"), []byte(stub), 0o755)
	run := func(pod, up string) string {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, sh, scriptPath)
		cmd.Env = append(os.Environ(), "PATH="+dir+":"+os.Getenv("PATH"), "POD_NAME="+pod, "POD_NAMESPACE=ns",
			"MESH_SERVICE=meshnode-mesh", "CLUSTER_DOMAIN=cluster.local", "REPLICAS=3", "UP="+up)
		out, _ := cmd.Output()
		return strings.TrimSpace(string(out))
	}
	want := "EXEC join /dns4/meshnode-0.meshnode-mesh.ns.svc.cluster.local/tcp/4001/p2p/" + peer + " --mesh-key mk1_secret --config /etc/meshnode/meshnode.conf"
	if got := run("meshnode-2", "meshnode-0"); got != want {
		t.Errorf("pod 2 with pod 0 up:\n got %q\nwant %q", got, want)
	}
	if got := run("meshnode-0", ""); got != "EXEC serve --config /etc/meshnode/meshnode.conf" {
		t.Errorf("pod 0 alone: %q", got)
	}
	if got := run("meshnode-0", "meshnode-1"); !strings.HasPrefix(got, "EXEC join /dns4/meshnode-1.") {
		t.Errorf("pod 0 restarting while pod 1 runs: %q", got)
	}
}
