package admin

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Config wires a node's admin API.
type Config struct {
	// Status snapshots the mesh; it must not block on the network.
	Status func() Status
	// Stats are the node's own live numbers (GET /api/metrics).
	Stats func() NodeStats
}

// Handler serves the admin API (/api/...) and the dashboard. Guarding it
// with the API key is the caller's job, as the dashboard page itself is
// public (it holds no data and asks for the key when the API wants one).
type Handler struct {
	cfg Config
	mux *http.ServeMux
}

// New makes the admin API.
func New(cfg Config) *Handler {
	h := &Handler{cfg: cfg, mux: http.NewServeMux()}
	h.mux.HandleFunc("/api/status", h.status)
	h.mux.HandleFunc("/api/events", h.events)
	h.mux.HandleFunc("/api/nodes", h.nodes)
	h.mux.HandleFunc("/api/nodes/{id}", h.node)
	h.mux.HandleFunc("/api/metrics", h.stats)
	h.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no admin endpoint %s (try /api/status, /api/events, /api/nodes, /api/metrics)", r.URL.Path))
	})
	return h
}

// ServeHTTP serves /api/*.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		writeError(w, http.StatusMethodNotAllowed, "the admin API is read-only: use GET")
		return
	}
	h.mux.ServeHTTP(w, r)
}

func (h *Handler) status(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, h.cfg.Status())
}

// events serves the recent events; ?since=RFC3339 keeps the newer ones,
// ?kind=K those of one kind.
func (h *Handler) events(w http.ResponseWriter, r *http.Request) {
	st := h.cfg.Status()
	out := Events{Schema: SchemaVersion, Events: []Event{}}
	var since time.Time
	if s := r.URL.Query().Get("since"); s != "" {
		t, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("since=%q: want an RFC 3339 time", s))
			return
		}
		since = t
	}
	kind := r.URL.Query().Get("kind")
	for _, ev := range st.Events {
		if ev.Time.After(since) && (kind == "" || ev.Kind == kind) {
			out.Events = append(out.Events, ev)
		}
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *Handler) nodes(w http.ResponseWriter, r *http.Request) {
	st := h.cfg.Status()
	writeJSON(w, http.StatusOK, struct {
		Schema string `json:"schema"`
		Nodes  []Node `json:"nodes"`
	}{SchemaVersion, st.Nodes})
}

func (h *Handler) node(w http.ResponseWriter, r *http.Request) {
	st := h.cfg.Status()
	n, ok := st.NodeByID(r.PathValue("id"))
	if !ok {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no node %q in the mesh (or more than one ends so)", r.PathValue("id")))
		return
	}
	writeJSON(w, http.StatusOK, n)
}

func (h *Handler) stats(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, h.cfg.Stats())
}

//go:embed dashboard.html
var dashboardHTML []byte

// WantsDashboard reports whether a request is a browser asking for the
// page at "/": GET (or HEAD) of "/" that accepts HTML. API clients that
// probe "/" keep getting the OpenAI API's JSON.
func WantsDashboard(r *http.Request) bool {
	if r.URL.Path != "/" || (r.Method != http.MethodGet && r.Method != http.MethodHead) {
		return false
	}
	return strings.Contains(r.Header.Get("Accept"), "text/html")
}

// Dashboard serves the dashboard page.
func Dashboard() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Type", "text/html; charset=utf-8")
		h.Set("Content-Length", strconv.Itoa(len(dashboardHTML)))
		h.Set("Cache-Control", "no-cache")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:")
		if r.Method == http.MethodHead {
			return
		}
		w.Write(dashboardHTML)
	})
}

// Root serves the dashboard to browsers at "/" and everything else with next.
func Root(next http.Handler) http.Handler {
	dash := Dashboard()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if WantsDashboard(r) {
			dash.ServeHTTP(w, r)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		writeError(w, http.StatusInternalServerError, "encoding the response: "+err.Error())
		return
	}
	data = append(data, '\n')
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Length", strconv.Itoa(len(data)))
	w.WriteHeader(code)
	w.Write(data)
}

// writeError answers in the OpenAI API's error shape, like the rest of the
// node's HTTP surface.
func writeError(w http.ResponseWriter, code int, msg string) {
	body, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": msg, "type": "invalid_request_error", "param": nil, "code": strings.ReplaceAll(strings.ToLower(http.StatusText(code)), " ", "_"),
	}})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	w.Write(append(body, '\n'))
}
