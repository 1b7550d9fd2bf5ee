package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"text/template"
	"time"
	"unicode/utf8"

	"github.com/meshnode/meshnode/node/admin"

	"github.com/meshnode/meshnode/node"
)

// Exit codes of meshnode status.
const (
	exitNotServing  = 1 // the mesh cannot serve its model
	exitUnreachable = 3 // no node answered, or it refused us
)

func runStatus(ctx context.Context, args []string) error {
	return statusCommand(ctx, os.Stdout, args)
}

type statusOptions struct {
	url, key string
	json     bool
	watch    bool
	interval time.Duration
	format   *template.Template
	color    bool
}

func statusCommand(ctx context.Context, w io.Writer, args []string) error {
	fs := newFlags("status [flags]", `Shows the mesh as the local node sees it: every node (peer ID, name,
addresses, engine, memory, layers, state, tokens/s, queue depth, the
latency of its pipeline hop), the pipeline as a chain, and what is wrong
when the mesh cannot serve. It reads the node's admin API (GET /api/status),
so the node must be running; --node points at another one.

Exit status: 0 when the mesh can serve its model, 1 when it cannot (no
placement, a stage missing, still loading), 3 when no node answers or it
refuses the API key, 2 on bad usage. Scripts and health checks can use it.

--json prints the status in its stable schema (meshnode.status/v1,
documented in node/admin); --watch redraws it in place every --interval.
With --config, the node's own configuration file gives the address (its
http setting) and the API key.`, `  meshnode status
  meshnode status --watch
  meshnode status --json | jq '.nodes[] | {name, state, tok_s: .stats.tokens_per_second}'
  meshnode status --node http://10.0.0.7:9337 --api-key "$KEY"
  meshnode status --config /etc/meshnode/meshnode.conf || echo "mesh cannot serve"
  meshnode status --format '{{.Self}}'                          # the node's peer ID`)
	nodeURL := fs.String("node", "http://127.0.0.1:9337", "the node's HTTP address (URL or HOST:PORT)")
	key := fs.String("api-key", "", "the node's API key, if it has one")
	keyFile := fs.String("api-key-file", "", "read the API key from this file")
	fs.String("config", "", "the node's configuration file: take the address (http) and API key from it")
	asJSON := fs.Bool("json", false, "print the status as JSON (schema meshnode.status/v1)")
	watch := fs.Bool("watch", false, "refresh in place until interrupted")
	interval := fs.Duration("interval", 2*time.Second, "how often --watch refreshes")
	format := fs.String("format", "", "print the status through a Go template instead, e.g. '{{.Self}}' or '{{range .Nodes}}{{.Name}} {{.State}}{{\"\\n\"}}{{end}}'")
	noColor := fs.Bool("no-color", false, "no colors (also when NO_COLOR is set or the output is not a terminal)")
	if err := parse(fs, args); err != nil {
		return err
	}
	base, apiKey, err := nodeEndpoint(fs, *nodeURL, *key, *keyFile)
	if err != nil {
		return err
	}
	if *interval < 100*time.Millisecond {
		return fmt.Errorf("--interval %s: too short (at least 100ms)", *interval)
	}
	opts := statusOptions{url: base, key: apiKey, json: *asJSON, watch: *watch, interval: *interval,
		color: !*noColor && os.Getenv("NO_COLOR") == "" && isTerminal(w)}
	if *format != "" {
		t, err := template.New("format").Parse(*format)
		if err != nil {
			return fmt.Errorf("--format: %w", err)
		}
		opts.format = t
	}
	if opts.watch {
		return watchStatus(ctx, w, opts)
	}
	var buf bytes.Buffer
	err = statusOnce(ctx, &buf, opts)
	w.Write(buf.Bytes())
	return err
}

// statusOnce fetches and prints the status; the error carries the exit code.
func statusOnce(ctx context.Context, w io.Writer, opts statusOptions) error {
	raw, st, err := fetchStatus(ctx, opts.url, opts.key)
	if err != nil {
		return err
	}
	switch {
	case opts.format != nil:
		if err := opts.format.Execute(w, st); err != nil {
			return fmt.Errorf("--format: %w", err)
		}
		if !strings.HasSuffix(opts.format.Root.String(), "\n") {
			fmt.Fprintln(w)
		}
	case opts.json:
		var out bytes.Buffer
		if err := json.Indent(&out, raw, "", "  "); err != nil {
			out.Reset()
			out.Write(raw)
		}
		w.Write(bytes.TrimRight(out.Bytes(), "\n"))
		fmt.Fprintln(w)
	default:
		renderStatus(w, opts.url, &st, opts.color)
	}
	if !st.CanServe() {
		msg := "the mesh cannot serve its model"
		if st.Problem != "" {
			msg += ": " + st.Problem
		}
		if opts.format != nil || opts.json {
			return &exitError{code: exitNotServing, msg: msg}
		}
		return &exitError{code: exitNotServing} // the table says why
	}
	return nil
}

// watchStatus redraws the status in place: cursor home, the frame with each
// line cleared to its end, then the rest of the screen cleared; no flicker.
func watchStatus(ctx context.Context, w io.Writer, opts statusOptions) error {
	fmt.Fprint(w, "\x1b[?25l\x1b[2J") // hide the cursor, clear once
	defer fmt.Fprint(w, "\x1b[?25h")
	var last error
	for {
		var frame bytes.Buffer
		last = statusOnce(ctx, &frame, opts)
		var ee *exitError
		if errors.As(last, &ee) && ee.msg != "" && ee.code == exitUnreachable {
			fmt.Fprintf(&frame, "%s\n", ee.msg)
		}
		fmt.Fprintf(&frame, "\n%s · every %s · Ctrl-C to stop\n", time.Now().Format("15:04:05"), opts.interval)
		var out bytes.Buffer
		out.WriteString("\x1b[H")
		for _, line := range strings.SplitAfter(frame.String(), "\n") {
			if strings.HasSuffix(line, "\n") {
				out.WriteString(strings.TrimSuffix(line, "\n") + "\x1b[K\n")
			} else if line != "" {
				out.WriteString(line + "\x1b[K")
			}
		}
		out.WriteString("\x1b[J")
		w.Write(out.Bytes())
		select {
		case <-ctx.Done():
			if last != nil {
				var ee *exitError
				if errors.As(last, &ee) {
					return &exitError{code: ee.code}
				}
			}
			return nil
		case <-time.After(opts.interval):
		}
	}
}

// nodeEndpoint resolves how a client command reaches the local node: the
// --node URL, unless only --config was given, whose http setting (the
// command's own, else serve's) then names the address; and the API key,
// read from --api-key-file when --api-key is not set.
func nodeEndpoint(fs *flag.FlagSet, nodeURL, key, keyFile string) (base, apiKey string, err error) {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if p := fs.Lookup("config").Value.String(); p != "" && !set["node"] {
		cf, err := loadConfig(p)
		if err != nil {
			return "", "", err
		}
		if addr, ok := cf.lookup(commandOf(fs), "http"); ok {
			nodeURL = localURL(addr)
		} else if addr, ok := cf.lookup("serve", "http"); ok {
			nodeURL = localURL(addr)
		}
	}
	if keyFile != "" && key == "" {
		b, err := os.ReadFile(keyFile)
		if err != nil {
			return "", "", fmt.Errorf("--api-key-file: %w", err)
		}
		key = strings.TrimSpace(string(b))
	}
	return normalizeURL(nodeURL), key, nil
}

// fetchStatus reads GET /api/status; errors are exitErrors with a message
// for the operator.
func fetchStatus(ctx context.Context, base, key string) ([]byte, admin.Status, error) {
	var st admin.Status
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/api/status", nil)
	if err != nil {
		return nil, st, &exitError{code: exitUnreachable, msg: fmt.Sprintf("bad --node %q: %v", base, err)}
	}
	req.Header.Set("Accept", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, st, &exitError{code: exitUnreachable, msg: fmt.Sprintf(`no meshnode answers at %s (%s).
  Is the node running? Start one with 'meshnode serve' or 'meshnode join', or
  point --node at it. A node answers once it knows the mesh's model.`, base, shortNetErr(err))}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, st, &exitError{code: exitUnreachable, msg: fmt.Sprintf("reading %s/api/status: %v", base, err)}
	}
	switch {
	case resp.StatusCode == http.StatusUnauthorized:
		return nil, st, &exitError{code: exitUnreachable, msg: fmt.Sprintf(
			"the node at %s wants its API key: pass --api-key or --api-key-file, or set MESHNODE_API_KEY", base)}
	case resp.StatusCode != http.StatusOK:
		return nil, st, &exitError{code: exitUnreachable, msg: fmt.Sprintf("%s/api/status: %s: %s", base, resp.Status, firstLine(raw))}
	}
	if err := json.Unmarshal(raw, &st); err != nil || st.Schema == "" {
		return nil, st, &exitError{code: exitUnreachable, msg: fmt.Sprintf("%s does not look like a meshnode admin API (GET /api/status gave no status)", base)}
	}
	return raw, st, nil
}

func shortNetErr(err error) string {
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		return op.Err.Error()
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err.Error()
	}
	return err.Error()
}

func firstLine(b []byte) string {
	s := strings.TrimSpace(string(b))
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	return s
}

// normalizeURL accepts HOST:PORT as well as a URL.
func normalizeURL(s string) string {
	s = strings.TrimRight(strings.TrimSpace(s), "/")
	if !strings.Contains(s, "://") {
		s = "http://" + s
	}
	return s
}

// localURL turns a node's --http address into one to reach it from the same
// machine: a wildcard host means loopback.
func localURL(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return normalizeURL(addr)
	}
	switch host {
	case "", "0.0.0.0":
		host = "127.0.0.1"
	case "::", "[::]":
		host = "::1"
	}
	return "http://" + net.JoinHostPort(host, port)
}

// isTerminal says whether v is a terminal: a character device, other than
// the null device (as in 'meshnode chat < /dev/null').
func isTerminal(v any) bool {
	f, ok := v.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	if err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		return false
	}
	null, err := os.Stat(os.DevNull)
	return err != nil || !os.SameFile(fi, null)
}

// renderStatus prints the status for people: a header, the pipeline as a
// chain, the hops, and a table of the nodes.
func renderStatus(w io.Writer, url string, st *admin.Status, color bool) {
	label := nodeLabels(st)
	paint := func(code, s string) string {
		if !color || code == "" {
			return s
		}
		return "\x1b[" + code + "m" + s + "\x1b[0m"
	}
	selfName := label(st.Self)
	version := ""
	if st.Version != "" {
		version = ", meshnode " + st.Version
	}
	fmt.Fprintf(w, "%s  as seen by %s at %s%s\n", paint("1", "meshnode mesh"), selfName, url, version)
	if st.Model != nil {
		fmt.Fprintf(w, "  model     %s (%s, %d layers, %s)\n", st.Model.Name, st.Model.Arch, st.Model.Layers, shortHash(st.Model.ID))
	} else {
		fmt.Fprintf(w, "  model     (not known yet)\n")
	}
	live, ready := 0, 0
	for _, n := range st.Nodes {
		switch n.State {
		case admin.StateDead, admin.StateLeft:
		default:
			live++
			if n.State == admin.StateReady {
				ready++
			}
		}
	}
	gone := len(st.Nodes) - live
	members := fmt.Sprintf("%d node%s (%d ready", live, plural(live), ready)
	if gone > 0 {
		members += fmt.Sprintf(", %d gone", gone)
	}
	members += ")"
	if st.CanServe() {
		fmt.Fprintf(w, "  mesh      %s · %s\n", paint("32", "serving"), members)
	} else {
		why := st.Problem
		if why == "" {
			why = "no complete pipeline"
		}
		fmt.Fprintf(w, "  mesh      %s: %s · %s\n", paint("31;1", "NOT SERVING"), why, members)
	}
	if len(st.Plan) > 0 {
		var chain []string
		for _, s := range st.Plan {
			part := fmt.Sprintf("%s [%d,%d)", label(s.Node), s.Start, s.End)
			if !s.Up {
				part += " (down)"
			}
			chain = append(chain, part)
		}
		pipelined := ""
		if st.Lanes > 1 {
			pipelined = fmt.Sprintf(" · pipelined: %d micro-batches in flight", st.Lanes)
		}
		fmt.Fprintf(w, "  pipeline  %s%s\n", strings.Join(chain, " → "), pipelined)
	} else {
		fmt.Fprintf(w, "  pipeline  (none)\n")
	}
	// The network legs of a request entering at the node asked: in to the
	// first stage, between stages, and the token back (legs within one
	// node are left out).
	var hops []string
	for i, h := range st.Hops {
		if h.From == h.To {
			continue
		}
		name := fmt.Sprintf("%s→%s", label(h.From), label(h.To))
		switch {
		case i == 0:
			name = "in " + name
		case i == len(st.Hops)-1:
			name = "back " + name
		}
		name += " " + ms(h.RTTMs)
		if h.Via == admin.ViaLocal {
			name += " (local socket)"
		}
		hops = append(hops, name)
	}
	if len(hops) > 0 {
		fmt.Fprintf(w, "  hops      %s\n", strings.Join(hops, " · "))
	} else if len(st.Hops) > 0 {
		fmt.Fprintf(w, "  hops      none: one node serves the whole model\n")
	}
	fmt.Fprintln(w)

	// The next hop of each stage, for the table.
	next := map[string]*admin.Hop{}
	for i := range st.Hops {
		if i > 0 { // hop 0 enters the pipeline at its first stage
			h := &st.Hops[i]
			if _, ok := next[h.From]; !ok {
				next[h.From] = h
			}
		}
	}
	rows := [][]string{{"NODE", "NAME", "STATE", "ENGINE", "MEMORY USED/OFFERED", "LAYERS", "TOK/S", "QUEUE", "NEXT HOP", "ADDRESS"}}
	colors := []string{""}
	for _, n := range st.Nodes {
		id := "…" + n.ShortID
		if n.Self {
			id += "*"
		}
		state := n.State
		if n.LoadingPct != nil {
			state += fmt.Sprintf(" %.0f%%", *n.LoadingPct)
		}
		if n.Since != nil {
			state += " " + ago(st.Time.Sub(*n.Since))
		}
		mem := "–"
		if n.MemOffered > 0 || n.MemUsed > 0 {
			used := "–"
			if n.Stats != nil {
				used = node.HumanBytes(n.MemUsed)
			}
			mem = fmt.Sprintf("%s / %s", used, node.HumanBytes(n.MemOffered))
		}
		var layers []string
		for _, s := range n.Serving {
			layers = append(layers, fmt.Sprintf("[%d,%d)", s.Start, s.End))
		}
		tps, queue := "–", "–"
		if n.Stats != nil && n.State != admin.StateDead && n.State != admin.StateLeft {
			v := n.Stats.TokensPerSecond
			if n.Stats.Stage != nil {
				v = n.Stats.Stage.TokensPerSecond
			}
			tps = fmt.Sprintf("%.1f", v)
			queue = fmt.Sprintf("%d", n.Stats.QueueDepth)
		}
		hop := "–"
		if h, ok := next[n.PeerID]; ok && n.State != admin.StateDead && n.State != admin.StateLeft {
			hop = fmt.Sprintf("→%s %s", label(h.To), ms(h.RTTMs))
			if h.Via == admin.ViaLocal {
				hop += " local"
			}
		}
		addr := "–"
		if len(n.Addrs) > 0 {
			addr = strings.TrimSuffix(n.Addrs[0], "/p2p/"+n.PeerID)
			if len(n.Addrs) > 1 {
				addr += fmt.Sprintf(" (+%d)", len(n.Addrs)-1)
			}
		}
		engine := n.Engine
		if n.Backend != "" {
			engine += "/" + n.Backend
		}
		if n.Stats != nil && n.Stats.Stage != nil && n.Stats.Stage.DecodePath == "fused" {
			engine += " fused"
		}
		rows = append(rows, []string{id, orDash(n.Name), state, orDash(engine), mem, orDash(strings.Join(layers, " ")), tps, queue, hop, addr})
		colors = append(colors, stateColor(n.State))
	}
	widths := make([]int, len(rows[0]))
	for _, r := range rows {
		for i, c := range r {
			widths[i] = max(widths[i], utf8.RuneCountInString(c))
		}
	}
	right := map[int]bool{6: true, 7: true}
	for ri, r := range rows {
		var b strings.Builder
		for i, c := range r {
			pad := strings.Repeat(" ", widths[i]-utf8.RuneCountInString(c))
			cell := c
			if ri == 0 {
				cell = paint("1", c)
			} else if i == 2 {
				cell = paint(colors[ri], c)
			}
			if right[i] {
				b.WriteString(pad + cell)
			} else if i == len(r)-1 {
				b.WriteString(cell)
			} else {
				b.WriteString(cell + pad)
			}
			if i < len(r)-1 {
				b.WriteString("  ")
			}
		}
		fmt.Fprintln(w, strings.TrimRight(b.String(), " "))
	}
	// A GPU node that could decode through meshnode's fused kernels and
	// does not is several times slower at one stream: say why.
	for _, n := range st.Nodes {
		if n.Stats != nil && n.Stats.Stage != nil && n.Stats.Stage.DecodeWhy != "" {
			fmt.Fprintf(w, "\n%s decodes on ggml, not meshnode's fused kernels: %s\n", label(n.PeerID), n.Stats.Stage.DecodeWhy)
		}
	}
}

// nodeLabels names nodes in the chain: by name when the mesh has one node of
// that name, else by short peer ID.
func nodeLabels(st *admin.Status) func(peer string) string {
	count := map[string]int{}
	for _, n := range st.Nodes {
		count[n.Name]++
	}
	names := map[string]string{}
	for _, n := range st.Nodes {
		if n.Name != "" && count[n.Name] == 1 {
			names[n.PeerID] = n.Name
		} else {
			names[n.PeerID] = "…" + n.ShortID
		}
	}
	return func(peer string) string {
		if s, ok := names[peer]; ok {
			return s
		}
		return "…" + admin.ShortID(peer)
	}
}

func stateColor(s string) string {
	switch s {
	case admin.StateReady:
		return "32"
	case admin.StateLoading:
		return "36"
	case admin.StateDraining, admin.StateSuspect:
		return "33"
	case admin.StateDead, admin.StateLeft:
		return "31"
	}
	return ""
}

func ms(v *float64) string {
	if v == nil {
		return "?"
	}
	switch {
	case *v == 0:
		return "0 ms"
	case *v < 10:
		return fmt.Sprintf("%.2f ms", *v)
	}
	return fmt.Sprintf("%.0f ms", *v)
}

func ago(d time.Duration) string {
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds ago", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm ago", int(d.Minutes()))
	}
	return fmt.Sprintf("%dh ago", int(d.Hours()))
}

func shortHash(id string) string {
	if len(id) > 12 {
		return id[:12] + "…"
	}
	return id
}

func orDash(s string) string {
	if s == "" {
		return "–"
	}
	return s
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}
