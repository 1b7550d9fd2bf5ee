package text

import (
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// pyStrip is Python's str.strip(), which Jinja's trim filter calls. Python
// also counts the separators U+001C..U+001F as whitespace; Go does not.
func pyStrip(s string) string {
	return strings.TrimFunc(s, func(r rune) bool {
		return unicode.IsSpace(r) || (r >= 0x1c && r <= 0x1f)
	})
}

// pyJSONString quotes s as json.dumps(s, ensure_ascii=False) does, which is
// what the tojson filter of Hugging Face's template environment calls.
func pyJSONString(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 2)
	b.WriteByte('"')
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == '"':
			b.WriteString(`\"`)
		case r == '\\':
			b.WriteString(`\\`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\b':
			b.WriteString(`\b`)
		case r == '\f':
			b.WriteString(`\f`)
		case r < 0x20:
			b.WriteString(`\u00`)
			b.WriteByte("0123456789abcdef"[r>>4])
			b.WriteByte("0123456789abcdef"[r&0xf])
		default:
			b.WriteString(s[i : i+size]) // invalid bytes pass through as they are
		}
		i += size
	}
	b.WriteByte('"')
	return b.String()
}

// strftime formats t with the C-locale subset of strftime directives that
// chat templates use; other directives are left as written.
func strftime(t time.Time, format string) string {
	var b strings.Builder
	for i := 0; i < len(format); i++ {
		c := format[i]
		if c != '%' || i+1 == len(format) {
			b.WriteByte(c)
			continue
		}
		i++
		pad := true
		if format[i] == '-' && i+1 < len(format) { // glibc: no padding
			pad = false
			i++
		}
		num := func(n int) {
			if pad && n < 10 {
				b.WriteByte('0')
			}
			b.WriteString(strconv.Itoa(n))
		}
		switch format[i] {
		case 'd':
			num(t.Day())
		case 'm':
			num(int(t.Month()))
		case 'Y':
			b.WriteString(strconv.Itoa(t.Year()))
		case 'y':
			num(t.Year() % 100)
		case 'b':
			b.WriteString(t.Month().String()[:3])
		case 'B':
			b.WriteString(t.Month().String())
		case 'a':
			b.WriteString(t.Weekday().String()[:3])
		case 'A':
			b.WriteString(t.Weekday().String())
		case 'H':
			num(t.Hour())
		case 'M':
			num(t.Minute())
		case 'S':
			num(t.Second())
		case '%':
			b.WriteByte('%')
		default:
			b.WriteByte('%')
			if !pad {
				b.WriteByte('-')
			}
			b.WriteByte(format[i])
		}
	}
	return b.String()
}
