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
		{"bench", "measure prefill and decode speed against ollama's stock engine", runBench},
		{"dev", "developer tools (gen-model)", runDev},
		{"version", "print the version", func(context.Context, []string) error {
			fmt.Println("meshnode", version)
			return nil
		}},
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
			switch {
			case err == nil, errors.Is(err, flag.ErrHelp):
				return 0
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

// newFlags makes a flag set whose --help prints a description, examples and
// the flags, and whose values can also come from MESHNODE_* variables.
func newFlags(name, synopsis, examples string) *flag.FlagSet {
	fs := flag.NewFlagSet("meshnode "+name, flag.ContinueOnError)
	fs.Usage = func() {
		w := fs.Output()
		fmt.Fprintf(w, "Usage: meshnode %s\n\n%s\n\nFlags (each also settable as MESHNODE_<FLAG> in the environment):\n", name, synopsis)
		fs.PrintDefaults()
		if examples != "" {
			fmt.Fprintf(w, "\nExamples:\n%s\n", examples)
		}
	}
	return fs
}

// parse applies MESHNODE_* environment variables to flags not given on the
// command line, then the command line.
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
		}
	})
	if err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "unexpected arguments: %s\n", strings.Join(fs.Args(), " "))
		return errUsage
	}
	return nil
}
