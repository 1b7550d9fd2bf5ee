package main

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// The configuration file (--config FILE, or MESHNODE_CONFIG) holds flags as
// `name = value` lines, TOML-like:
//
//	# comments start with # (or ;)
//	http = "0.0.0.0:9337"        # strings may be quoted ("..." with escapes, '...' as is)
//	api-key-file = /etc/meshnode/api-key
//	listen = ["/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/4001"]   # lists join with commas
//	mdns = true
//
//	[serve]                      # keys below apply to `meshnode serve` only
//	model = /var/lib/meshnode/models/llama-3.2-1b-q4_0.gguf
//	split = true
//
// Names are the flags' names (underscores work as dashes). Keys before any
// section apply to every command that reads the file; a section named after
// a command applies to it alone. A key the command does not know is an
// error (a typo must not pass silently), except in `meshnode status`, which
// takes only what it needs. The command line wins over MESHNODE_*
// environment variables, which win over the file.

// configEntry is one `key = value` line.
type configEntry struct {
	key, value string
	line       int
}

// configFile is a parsed configuration file.
type configFile struct {
	path     string
	top      []configEntry
	sections map[string][]configEntry
}

// lenientConfig lists the commands that ignore keys they do not know.
var lenientConfig = map[string]bool{"status": true, "chat": true}

func loadConfig(path string) (*configFile, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("--config: %w", err)
	}
	defer f.Close()
	cf := &configFile{path: path, sections: map[string][]configEntry{}}
	known := map[string]bool{}
	for _, c := range commands() {
		known[c.name] = true
	}
	section := ""
	seen := map[string]int{}
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if n == 1 {
			line = strings.TrimPrefix(line, "\ufeff")
		}
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		bad := func(format string, args ...any) error {
			return fmt.Errorf("%s:%d: %s", path, n, fmt.Sprintf(format, args...))
		}
		if line[0] == '[' {
			end := strings.IndexByte(line, ']')
			if end < 0 || strings.TrimSpace(stripComment(line[end+1:])) != "" {
				return nil, bad("a section header is [COMMAND]")
			}
			section = strings.TrimSpace(line[1:end])
			if !known[section] {
				return nil, bad("unknown section [%s]: sections are named after commands (serve, join, status, ...)", section)
			}
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			return nil, bad("want NAME = VALUE, got %q", line)
		}
		key := strings.ToLower(strings.ReplaceAll(strings.TrimSpace(k), "_", "-"))
		if !validKey(key) {
			return nil, bad("%q is not a setting name", strings.TrimSpace(k))
		}
		val, err := configValue(strings.TrimSpace(v))
		if err != nil {
			return nil, bad("%s: %v", key, err)
		}
		scoped := section + "." + key
		if prev, dup := seen[scoped]; dup {
			return nil, bad("%s is already set on line %d", key, prev)
		}
		seen[scoped] = n
		e := configEntry{key: key, value: val, line: n}
		if section == "" {
			cf.top = append(cf.top, e)
		} else {
			cf.sections[section] = append(cf.sections[section], e)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("--config %s: %w", path, err)
	}
	return cf, nil
}

func validKey(k string) bool {
	if k == "" {
		return false
	}
	for _, c := range k {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

// configValue reads a value: "quoted" (Go/TOML escapes), 'literal',
// [a, b] (a list, joined with commas), or bare text up to a # comment.
func configValue(v string) (string, error) {
	switch {
	case v == "":
		return "", nil
	case v[0] == '"':
		end := closingQuote(v)
		if end < 0 {
			return "", fmt.Errorf("unterminated string")
		}
		s, err := strconv.Unquote(v[:end+1])
		if err != nil {
			return "", fmt.Errorf("bad string %s: %w", v[:end+1], err)
		}
		if rest := strings.TrimSpace(stripComment(v[end+1:])); rest != "" {
			return "", fmt.Errorf("unexpected %q after the string", rest)
		}
		return s, nil
	case v[0] == '\'':
		end := strings.IndexByte(v[1:], '\'')
		if end < 0 {
			return "", fmt.Errorf("unterminated string")
		}
		if rest := strings.TrimSpace(stripComment(v[end+2:])); rest != "" {
			return "", fmt.Errorf("unexpected %q after the string", rest)
		}
		return v[1 : end+1], nil
	case v[0] == '[':
		end := strings.LastIndexByte(v, ']')
		if end < 0 || strings.TrimSpace(stripComment(v[end+1:])) != "" {
			return "", fmt.Errorf("a list is [A, B, ...] on one line")
		}
		var items []string
		for _, it := range splitList(v[1:end]) {
			if it = strings.TrimSpace(it); it == "" {
				continue
			}
			s, err := configValue(it)
			if err != nil {
				return "", err
			}
			items = append(items, s)
		}
		return strings.Join(items, ","), nil
	}
	return strings.TrimSpace(stripComment(v)), nil
}

// closingQuote finds the quote that ends a "..." string starting at v[0].
func closingQuote(v string) int {
	for i := 1; i < len(v); i++ {
		switch v[i] {
		case '\\':
			i++
		case '"':
			return i
		}
	}
	return -1
}

// stripComment drops a # comment that follows whitespace (a bare # inside a
// value, as in a URL fragment, stays).
func stripComment(s string) string {
	for i := 0; i < len(s); i++ {
		if s[i] == '#' && (i == 0 || s[i-1] == ' ' || s[i-1] == '\t') {
			return s[:i]
		}
	}
	return s
}

// splitList splits list items on commas outside quotes.
func splitList(s string) []string {
	var out []string
	start, quote := 0, byte(0)
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case quote != 0:
			if c == '\\' && quote == '"' {
				i++
			} else if c == quote {
				quote = 0
			}
		case c == '"' || c == '\'':
			quote = c
		case c == ',':
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return append(out, s[start:])
}

// commandOf is the command a flag set belongs to ("serve" for "meshnode
// serve [flags]").
func commandOf(fs *flag.FlagSet) string {
	f := strings.Fields(fs.Name())
	if len(f) < 2 {
		return ""
	}
	return f[1]
}

// entries are the settings of the file that apply to a command.
func (cf *configFile) entries(cmd string) []configEntry {
	return append(append([]configEntry{}, cf.top...), cf.sections[cmd]...)
}

// lookup returns a setting for a command: its section first, then the top.
func (cf *configFile) lookup(cmd, key string) (string, bool) {
	for _, list := range [][]configEntry{cf.sections[cmd], cf.top} {
		for _, e := range list {
			if e.key == key {
				return e.value, true
			}
		}
	}
	return "", false
}

// applyConfig sets, from the --config file, the flags that neither the
// command line nor the environment set.
func applyConfig(fs *flag.FlagSet, set map[string]bool) error {
	cfgFlag := fs.Lookup("config")
	if cfgFlag == nil || cfgFlag.Value.String() == "" {
		return nil
	}
	cf, err := loadConfig(cfgFlag.Value.String())
	if err != nil {
		return err
	}
	cmd := commandOf(fs)
	for _, e := range cf.entries(cmd) {
		if e.key == "config" {
			return fmt.Errorf("%s:%d: a config file cannot name another", cf.path, e.line)
		}
		f := fs.Lookup(e.key)
		if f == nil {
			if lenientConfig[cmd] {
				continue
			}
			return fmt.Errorf("%s:%d: unknown setting %q for meshnode %s (see meshnode %s --help; put settings of one command under [COMMAND])", cf.path, e.line, e.key, cmd, cmd)
		}
		if set[f.Name] {
			continue
		}
		if err := fs.Set(f.Name, e.value); err != nil {
			return fmt.Errorf("%s:%d: %s = %q: %w", cf.path, e.line, e.key, e.value, err)
		}
	}
	return nil
}
