package main

import (
	"fmt"
	"io"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/meshnode/meshnode/node"
)

func newLogger(format, level string) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	var cfg zap.Config
	switch format {
	case "console":
		cfg = zap.NewDevelopmentConfig()
		cfg.EncoderConfig.EncodeLevel = zapcore.CapitalColorLevelEncoder
		cfg.EncoderConfig.EncodeTime = zapcore.TimeEncoderOfLayout("15:04:05.000")
		cfg.DisableStacktrace = true
		cfg.Development = false
	case "json":
		cfg = zap.NewProductionConfig()
	default:
		return nil, fmt.Errorf("--log-format %q: want console or json", format)
	}
	cfg.Level = zap.NewAtomicLevelAt(lvl)
	return cfg.Build()
}

// newProgress prints long work as one updating line per task: what, bytes,
// rate and time left.
func newProgress(w io.Writer) func(what string, done, total uint64) {
	var mu sync.Mutex
	var cur string
	var start, last time.Time
	return func(what string, done, total uint64) {
		mu.Lock()
		defer mu.Unlock()
		now := time.Now()
		if what != cur {
			cur, start = what, now
		}
		finished := total > 0 && done >= total
		if !finished && now.Sub(last) < 200*time.Millisecond {
			return
		}
		last = now
		el := now.Sub(start).Seconds()
		rate := float64(done) / max(el, 1e-3)
		line := fmt.Sprintf("\r%s: %s", what, node.HumanBytes(done))
		if total > 0 {
			line += fmt.Sprintf(" / %s (%.0f%%)", node.HumanBytes(total), 100*float64(done)/float64(total))
			if rate > 0 && !finished {
				line += fmt.Sprintf(", %s/s, %s left", node.HumanBytes(uint64(rate)), time.Duration(float64(total-done)/rate*float64(time.Second)).Round(time.Second))
			}
		}
		fmt.Fprintf(w, "%-100s", line)
		if finished {
			fmt.Fprintln(w)
		}
	}
}
