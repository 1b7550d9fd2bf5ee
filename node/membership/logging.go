package membership

import (
	"bytes"
	"strings"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// zapWriter turns memberlist's log lines ("[LEVEL] memberlist: message") into
// zap entries at the matching level; memberlist only takes a *log.Logger.
type zapWriter struct{ log *zap.Logger }

func (w *zapWriter) Write(p []byte) (int, error) {
	for _, line := range bytes.Split(p, []byte{'\n'}) {
		if s := strings.TrimSpace(string(line)); s != "" {
			w.line(s)
		}
	}
	return len(p), nil
}

func (w *zapWriter) line(s string) {
	lvl := zapcore.InfoLevel
	if rest, ok := strings.CutPrefix(s, "["); ok {
		if tag, msg, ok := strings.Cut(rest, "]"); ok {
			switch tag {
			case "DEBUG", "TRACE":
				lvl = zapcore.DebugLevel
			case "INFO":
				lvl = zapcore.InfoLevel
			case "WARN":
				lvl = zapcore.WarnLevel
			case "ERR", "ERROR":
				lvl = zapcore.ErrorLevel
			}
			s = strings.TrimSpace(msg)
		}
	}
	s = strings.TrimPrefix(s, "memberlist: ")
	// A node of another mesh (or a stale key) shows up as undecryptable
	// gossip: say so plainly, as a refusal rather than an internal error.
	if strings.Contains(strings.ToLower(s), "no installed keys could decrypt") {
		w.log.Warn("refused gossip: wrong mesh key? (" + s + ")")
		return
	}
	if ce := w.log.Check(lvl, s); ce != nil {
		ce.Write()
	}
}
