package admin

import (
	"net/http"
	"net/http/pprof"
)

// Profiles serves Go's runtime profiles under /debug/pprof/ (CPU, heap,
// goroutines, execution trace), for `go tool pprof` against a live node and
// for `meshnode bench --mesh --profile-dir`. The caller guards it like the
// rest of the admin API: it shows the process's internals.
func Profiles() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}
