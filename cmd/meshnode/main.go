// Command meshnode pools machines into one LLM inference mesh and serves it
// through an OpenAI-compatible API. This file holds flags and wiring only.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string) error
}

func commands() []command {
	return []command{
		{"serve", "start a mesh that serves a model through the OpenAI API", runServe},
		{"join", "join this machine to a running mesh", runJoin},
		{"leave", "make the local node leave the mesh gracefully", runLeave},
		{"status", "show the mesh: nodes, pipeline, speed, health", runStatus},
		{"chat", "talk to the mesh's model in the terminal", runChat},
		{"bench", "measure prefill and decode speed against ollama's stock engine", runBench},
		{"dev", "developer tools (gen-model)", runDev},
		{"version", "print the version", runVersion},
	}
}

func usage(w io.Writer) {
	fmt.Fprintf(w, `meshnode pools machines into one LLM inference mesh behind one
OpenAI-compatible endpoint.

Usage:
  meshnode <command> [flags]

Commands:
`)
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-9s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(w, `
Examples:
  meshnode serve                          # the small default model on 127.0.0.1:9337
  meshnode serve --model ./llama-3.2-1b-q4_0.gguf
  meshnode join /ip4/192.168.1.5/tcp/4001/p2p/12D3KooW... --mesh-key mk1_...   # on another machine
  meshnode chat                           # a conversation with the model, in the terminal
  curl http://127.0.0.1:9337/v1/chat/completions -d '{"model":"stories260K","messages":[{"role":"user","content":"Hi"}]}'

Run 'meshnode <command> --help' for a command's flags.
`)
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:]))
}

func run(ctx context.Context, args []string) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(os.Stdout)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	for _, c := range commands() {
		if c.name == args[0] {
			err := c.run(ctx, args[1:])
			var ee *exitError
			switch {
			case err == nil, errors.Is(err, flag.ErrHelp):
				return 0
			case errors.As(err, &ee):
				if ee.msg != "" {
					fmt.Fprintf(os.Stderr, "meshnode %s: %s\n", c.name, ee.msg)
				}
				return ee.code
			case errors.Is(err, errUsage):
				return 2
			case errors.Is(err, context.Canceled):
				return 0
			}
			fmt.Fprintf(os.Stderr, "meshnode %s: %v\n", c.name, err)
			return 1
		}
	}
	fmt.Fprintf(os.Stderr, "meshnode: unknown command %q\n\n", args[0])
	usage(os.Stderr)
	return 2
}

var errUsage = errors.New("usage")

// exitError ends a command with a given exit code; msg, if set, goes to
// stderr.
type exitError struct {
	code int
	msg  string
}

func (e *exitError) Error() string { return e.msg }

func runVersion(_ context.Context, args []string) error {
	fs := newFlags("version", "Prints meshnode's version (set at build time), Go version and platform.", `  meshnode version`)
	if err := parse(fs, args); err != nil {
		return err
	}
	fmt.Printf("meshnode %s (%s, %s/%s)\n", version, runtime.Version(), runtime.GOOS, runtime.GOARCH)
	return nil
}

// newFlags makes a flag set whose --help prints a description, examples and
// the flags, and whose values can also come from MESHNODE_* variables.
func newFlags(name, synopsis, examples string) *flag.FlagSet {
	fs := flag.NewFlagSet("meshnode "+name, flag.ContinueOnError)
	fs.Usage = func() {
		w := fs.Output()
		fmt.Fprintf(w, "Usage: meshnode %s\n\n%s\n\nFlags (each also settable as MESHNODE_<FLAG> in the environment", name, synopsis)
		if fs.Lookup("config") != nil {
			fmt.Fprint(w, ", or as FLAG = VALUE in the --config file")
		}
		fmt.Fprint(w, "):\n")
		fs.PrintDefaults()
		if examples != "" {
			fmt.Fprintf(w, "\nExamples:\n%s\n", examples)
		}
	}
	return fs
}

// parse sets the flags from the command line, then from MESHNODE_*
// environment variables for flags not on it, then, when the command has a
// --config flag and it names a file, from that file for the flags still
// unset: the command line wins over the environment, which wins over the
// file.
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return errUsage
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] || err != nil {
			return
		}
		env := "MESHNODE_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v, ok := os.LookupEnv(env); ok {
			if e := fs.Set(f.Name, v); e != nil {
				err = fmt.Errorf("%s=%q: %w", env, v, e)
			}
			set[f.Name] = true
		}
	})
	if err != nil {
		return err
	}
	if err := applyConfig(fs, set); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "unexpected arguments: %s\n", strings.Join(fs.Args(), " "))
		return errUsage
	}
	return nil
}

// parseWithArgs is parse for a command that takes arguments as well as
// flags, in any order; "--" ends the flags. It returns the arguments.
func parseWithArgs(fs *flag.FlagSet, args []string) ([]string, error) {
	var flags, positional []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "--":
			positional = append(positional, args[i+1:]...)
			i = len(args)
		case strings.HasPrefix(a, "-") && a != "-":
			flags = append(flags, a)
			name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
			if f := fs.Lookup(name); f != nil && !hasValue && !isBoolFlag(f) && i+1 < len(args) {
				i++
				flags = append(flags, args[i]) // the flag's value
			}
		default:
			positional = append(positional, a)
		}
	}
	return positional, parse(fs, flags)
}

func isBoolFlag(f *flag.Flag) bool {
	b, ok := f.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}
