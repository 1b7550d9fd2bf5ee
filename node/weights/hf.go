package weights

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// HFRef names a file in a Hugging Face model repository.
type HFRef struct {
	Repo     string // "org/name"
	File     string // path inside the repository, "dir/model.gguf"
	Revision string // branch, tag or commit; "main" when not given
}

func (r HFRef) String() string {
	return "hf://" + r.Repo + "/" + r.File + "@" + r.Revision
}

// ParseHFURL parses hf://ORG/REPO/PATH/FILE[@REVISION]. The revision is
// split at the last "@" so that branch names with slashes (refs/pr/1)
// work; a file name cannot then hold "@", which no GGUF on the Hub does.
func ParseHFURL(s string) (HFRef, error) {
	rest, ok := strings.CutPrefix(s, "hf://")
	if !ok {
		return HFRef{}, fmt.Errorf("%q is not an hf:// URL (want hf://ORG/REPO/PATH/FILE.gguf[@REVISION])", s)
	}
	ref := HFRef{Revision: "main"}
	if i := strings.LastIndexByte(rest, '@'); i >= 0 {
		ref.Revision = rest[i+1:]
		rest = rest[:i]
		if ref.Revision == "" {
			return HFRef{}, fmt.Errorf("%q: empty revision after @", s)
		}
		if strings.Contains(ref.Revision, "..") || strings.ContainsAny(ref.Revision, "?#\\ ") {
			return HFRef{}, fmt.Errorf("%q: invalid revision %q", s, ref.Revision)
		}
	}
	segs := strings.Split(rest, "/")
	if len(segs) < 3 {
		return HFRef{}, fmt.Errorf("%q: want hf://ORG/REPO/PATH/FILE, got no file path", s)
	}
	for _, seg := range segs {
		// Empty, "." and ".." segments would make the resolve URL point
		// somewhere other than the file named.
		if seg == "" || seg == "." || seg == ".." || strings.ContainsAny(seg, "?#\\") {
			return HFRef{}, fmt.Errorf("%q: invalid path segment %q", s, seg)
		}
	}
	ref.Repo = segs[0] + "/" + segs[1]
	ref.File = strings.Join(segs[2:], "/")
	return ref, nil
}

// HFOptions configure OpenHF. Zero values take the defaults.
type HFOptions struct {
	Endpoint string       // default HFEndpoint()
	Token    string       // default $HF_TOKEN; sent only to the endpoint's host
	Client   *http.Client // default: a client with a 30 s header timeout

	Retries      int           // attempts after transient failures (5xx, resets) without progress; default 5
	RetryBackoff time.Duration // first wait between attempts, doubled each time; default 500 ms
	StallTimeout time.Duration // a response that delivers nothing for this long is retried; default 60 s
}

// HFSource reads a file on the Hugging Face Hub by HTTP range requests.
//
// It pins the file when opened: every later request goes to the resolved
// commit (/resolve/{commit}/...), not to the branch, and checks that the
// file's ETag is still the pinned one, so the bytes of one download all
// come from one version of the file.
//
// The Hub's ETag of an LFS file is the SHA-256 of the whole file. A
// partial download cannot be checked against it; what guarantees a slice
// is the pinning: the commit is immutable and the ETag is rechecked on
// every request. The SHA-256 is kept as the source's ID, which makes slices
// fetched from the Hub interchangeable with slices fetched from peers (whose
// file ID is that same hash) or cut from a local copy.
type HFSource struct {
	ref      HFRef
	endpoint *url.URL
	token    string
	client   *http.Client
	retries  int
	backoff  time.Duration
	stall    time.Duration
	ctx      context.Context

	commit       string // pinned revision
	etag         string // pinned ETag, normalised
	linkedETag   bool   // etag came from X-Linked-Etag (an LFS file behind a redirect)
	size         int64
	id           string
	resolvedPath string // {endpoint}/{repo}/resolve/{commit}/{file}

	mu      sync.Mutex
	cdnETag string // ETag first seen on the redirect target, held constant

	counters
}

const maxRedirects = 10

// OpenHF resolves ref on the Hub and pins it. ctx bounds the resolution and
// the reads made through ReadAt (ReadAtContext takes its own context).
func OpenHF(ctx context.Context, ref HFRef, opts HFOptions) (*HFSource, error) {
	if ref.Revision == "" {
		ref.Revision = "main"
	}
	ep := opts.Endpoint
	if ep == "" {
		ep = HFEndpoint()
	}
	u, err := url.Parse(strings.TrimRight(ep, "/"))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("invalid Hugging Face endpoint %q", ep)
	}
	s := &HFSource{
		ref:      ref,
		endpoint: u,
		token:    opts.Token,
		retries:  opts.Retries,
		backoff:  opts.RetryBackoff,
		stall:    opts.StallTimeout,
		ctx:      ctx,
	}
	if s.token == "" {
		s.token = os.Getenv("HF_TOKEN")
	}
	if s.retries <= 0 {
		s.retries = 5
	}
	if s.backoff <= 0 {
		s.backoff = 500 * time.Millisecond
	}
	if s.stall <= 0 {
		s.stall = time.Minute
	}
	if opts.Client != nil {
		c := *opts.Client
		s.client = &c
	} else {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.ResponseHeaderTimeout = 30 * time.Second
		tr.MaxIdleConnsPerHost = 16 // FetchSlice reads several tensors at once
		s.client = &http.Client{Transport: tr}
	}
	// Redirects are followed by hand: the client's own policy would forward
	// the token to subdomains of the hub (its CDN), and the hub's headers on
	// the redirect itself are what pin the file.
	s.client.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

	if err := s.resolve(ctx); err != nil {
		return nil, fmt.Errorf("opening %s: %w", ref, err)
	}
	return s, nil
}

func (s *HFSource) resolveURL(rev string) string {
	esc := func(p string) string {
		segs := strings.Split(p, "/")
		for i, seg := range segs {
			segs[i] = url.PathEscape(seg)
		}
		return strings.Join(segs, "/")
	}
	// The revision is one path segment even when it holds slashes, as the
	// Hub expects (refs%2Fpr%2F1).
	return s.endpoint.String() + "/" + esc(s.ref.Repo) + "/resolve/" + url.PathEscape(rev) + "/" + esc(s.ref.File)
}

// onHub says whether u is the hub's own host, the only one that may see
// the token. The scheme must match too so a redirect to plain http cannot
// leak it.
func (s *HFSource) onHub(u *url.URL) bool {
	return strings.EqualFold(u.Host, s.endpoint.Host) && u.Scheme == s.endpoint.Scheme
}

func normETag(e string) string {
	e = strings.TrimPrefix(strings.TrimSpace(e), "W/")
	return strings.Trim(e, `"`)
}

func isHex(s string) bool {
	for _, c := range s {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return s != ""
}

// resolve finds the commit, ETag and size of the file, as the Hub's own
// clients do: a HEAD on the resolve URL, reading the X-Repo-Commit,
// X-Linked-Etag and X-Linked-Size headers of the hub's answer (a redirect
// to the CDN for LFS files, which need not be followed), else ETag and
// Content-Length of the file itself. Servers that refuse HEAD get a
// one-byte range GET instead.
func (s *HFSource) resolve(ctx context.Context) error {
	err := s.probe(ctx, http.MethodHead)
	var se *httpStatusError
	if errors.As(err, &se) && se.code == http.StatusMethodNotAllowed || errors.Is(err, errSizeUnknown) {
		err = s.probe(ctx, http.MethodGet)
	}
	if err != nil {
		return err
	}
	if s.commit == "" {
		// A server that does not name the commit (a plain mirror) cannot be
		// pinned by revision; the ETag check still catches a change, and
		// without an ETag either nothing would.
		if s.etag == "" {
			return fmt.Errorf("the server gives neither X-Repo-Commit nor ETag: the file cannot be pinned")
		}
		s.commit = s.ref.Revision
	}
	switch {
	case len(s.etag) == 64 && isHex(s.etag):
		s.id = s.etag // an LFS file: the SHA-256 of its content
	case len(s.etag) == 40 && isHex(s.etag):
		s.id = s.etag // a file kept in git: its blob hash
	default:
		s.id = "hf:" + s.ref.Repo + "/" + s.ref.File + "@" + s.commit + "#" + s.etag
	}
	s.resolvedPath = s.resolveURL(s.commit)
	return nil
}

var errSizeUnknown = errors.New("the server did not give the file's size")

func (s *HFSource) probe(ctx context.Context, method string) error {
	cur, err := url.Parse(s.resolveURL(s.ref.Revision))
	if err != nil {
		return err
	}
	var commit, linked string
	linkedSize := int64(-1)
	for range maxRedirects {
		req, err := http.NewRequestWithContext(ctx, method, cur.String(), nil)
		if err != nil {
			return err
		}
		if method == http.MethodGet {
			req.Header.Set("Range", "bytes=0-0")
		}
		if s.token != "" && s.onHub(cur) {
			req.Header.Set("Authorization", "Bearer "+s.token)
		}
		s.requests.Add(1)
		resp, err := s.client.Do(req)
		if err != nil {
			return err
		}
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		s.fetched.Add(uint64(len(body)))
		if s.onHub(cur) {
			if c := resp.Header.Get("X-Repo-Commit"); c != "" {
				commit = c
			}
			if e := resp.Header.Get("X-Linked-Etag"); e != "" {
				linked = normETag(e)
			}
			if v := resp.Header.Get("X-Linked-Size"); v != "" {
				if n, err := strconv.ParseInt(v, 10, 64); err == nil && n >= 0 {
					linkedSize = n
				}
			}
		}
		switch {
		case isRedirect(resp.StatusCode):
			if s.onHub(cur) && linked != "" && linkedSize >= 0 {
				s.commit, s.etag, s.linkedETag, s.size = commit, linked, true, linkedSize
				return nil
			}
			loc, err := cur.Parse(resp.Header.Get("Location"))
			if err != nil || resp.Header.Get("Location") == "" {
				return fmt.Errorf("%s: redirect without a valid Location", resp.Status)
			}
			cur = loc
			continue
		case resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusPartialContent:
			s.commit = commit
			if linked != "" {
				s.etag, s.linkedETag = linked, true
			} else {
				s.etag = normETag(resp.Header.Get("ETag"))
				if !s.onHub(cur) {
					s.cdnETag = s.etag
				}
			}
			size := linkedSize
			if size < 0 && resp.StatusCode == http.StatusPartialContent {
				if _, _, total, err := parseContentRange(resp.Header.Get("Content-Range")); err == nil {
					size = total
				}
			}
			if size < 0 && resp.StatusCode == http.StatusOK {
				size = resp.ContentLength
			}
			if size < 0 {
				return errSizeUnknown
			}
			s.size = size
			return nil
		default:
			return s.statusError(resp, body)
		}
	}
	return fmt.Errorf("more than %d redirects", maxRedirects)
}

func isRedirect(code int) bool {
	switch code {
	case http.StatusMovedPermanently, http.StatusFound, http.StatusSeeOther, http.StatusTemporaryRedirect, http.StatusPermanentRedirect:
		return true
	}
	return false
}

// httpStatusError is an unexpected answer; transient ones are retried.
type httpStatusError struct {
	code int
	msg  string
}

func (e *httpStatusError) Error() string { return e.msg }

func (e *httpStatusError) transient() bool {
	return e.code >= 500 || e.code == http.StatusTooManyRequests || e.code == http.StatusRequestTimeout
}

// statusError explains a failed answer in the user's terms. The Hub
// answers 401 both for private or gated repositories and for ones that do
// not exist, so the hint covers both.
func (s *HFSource) statusError(resp *http.Response, body []byte) error {
	detail := resp.Header.Get("X-Error-Message")
	if detail == "" {
		detail = strings.TrimSpace(string(body))
		if len(detail) > 200 {
			detail = detail[:200]
		}
	}
	if detail != "" {
		detail = " (" + detail + ")"
	}
	switch resp.StatusCode {
	case http.StatusUnauthorized, http.StatusForbidden:
		hint := "set HF_TOKEN?"
		if s.token != "" {
			hint = "HF_TOKEN was sent; does it grant access to this repository?"
		}
		return fmt.Errorf("%w: %s for %s%s: the repository may be private, gated or missing; %s", ErrUnauthorized, resp.Status, s.ref, detail, hint)
	case http.StatusNotFound:
		return fmt.Errorf("%w: %s at revision %s in %s%s", ErrNotFound, s.ref.File, s.ref.Revision, s.ref.Repo, detail)
	}
	return &httpStatusError{code: resp.StatusCode, msg: fmt.Sprintf("%s from %s%s", resp.Status, resp.Request.URL.Host, detail)}
}

// Size is the file's size.
func (s *HFSource) Size() int64 { return s.size }

// ID is the pinned content identity: the SHA-256 of an LFS file, the git
// blob hash of a small file, else repository, path, commit and ETag.
func (s *HFSource) ID() string { return s.id }

// Commit is the pinned commit every read goes to.
func (s *HFSource) Commit() string { return s.commit }

// ETag is the pinned ETag (for LFS files, the whole file's SHA-256).
func (s *HFSource) ETag() string { return s.etag }

// Stats counts the bytes and requests sent so far.
func (s *HFSource) Stats() Stats { return s.stats() }

func (s *HFSource) String() string { return s.ref.Repo + "/" + s.ref.File + "@" + s.commit }

// ReadAt reads with the context given to OpenHF.
func (s *HFSource) ReadAt(p []byte, off int64) (int, error) {
	return s.ReadAtContext(s.ctx, p, off)
}

// ReadAtContext reads len(p) bytes at off with one range request, retrying
// transient failures from where the last attempt stopped.
func (s *HFSource) ReadAtContext(ctx context.Context, p []byte, off int64) (int, error) {
	want, eof := clampRange(off, len(p), s.size)
	if want == 0 {
		return 0, eof
	}
	done, failures := 0, 0
	for done < want {
		n, err := s.readOnce(ctx, p[done:want], off+int64(done))
		done += n
		if err == nil {
			continue
		}
		if cerr := ctx.Err(); cerr != nil {
			return done, cerr
		}
		var t *transientError
		if !errors.As(err, &t) {
			return done, err
		}
		// Progress resets the count: a flaky link that keeps delivering
		// should finish, one that delivers nothing should not be retried
		// forever.
		if n > 0 {
			failures = 0
		}
		failures++
		if failures > s.retries {
			return done, fmt.Errorf("reading %s after %d attempts: %w", s, failures, err)
		}
		wait := s.backoff << min(failures-1, 6)
		wait += rand.N(wait/4 + 1)
		select {
		case <-ctx.Done():
			return done, ctx.Err()
		case <-time.After(wait):
		}
	}
	return done, eof
}

// transientError marks a failure worth retrying.
type transientError struct{ err error }

func (e *transientError) Error() string { return e.err.Error() }
func (e *transientError) Unwrap() error { return e.err }

// readOnce makes one range request for p at off, following redirects, and
// returns how many bytes it delivered.
func (s *HFSource) readOnce(ctx context.Context, p []byte, off int64) (int, error) {
	cur, err := url.Parse(s.resolvedPath)
	if err != nil {
		return 0, err
	}
	// A response that stops delivering is abandoned after the stall
	// timeout; the timer is pushed back on every read.
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stall := time.AfterFunc(s.stall, cancel)
	defer stall.Stop()
	last := int64(len(p)) - 1 + off
	for range maxRedirects {
		req, err := http.NewRequestWithContext(rctx, http.MethodGet, cur.String(), nil)
		if err != nil {
			return 0, err
		}
		req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", off, last))
		hub := s.onHub(cur)
		if s.token != "" && hub {
			req.Header.Set("Authorization", "Bearer "+s.token)
		}
		s.requests.Add(1)
		resp, err := s.client.Do(req)
		if err != nil {
			return 0, s.netError(ctx, err)
		}
		if err := s.checkETag(resp, hub); err != nil {
			resp.Body.Close()
			return 0, err
		}
		switch {
		case isRedirect(resp.StatusCode):
			resp.Body.Close()
			loc, err := cur.Parse(resp.Header.Get("Location"))
			if err != nil || resp.Header.Get("Location") == "" {
				return 0, fmt.Errorf("%s: redirect without a valid Location", resp.Status)
			}
			cur = loc
			continue
		case resp.StatusCode == http.StatusPartialContent:
			defer resp.Body.Close()
			a, b, total, err := parseContentRange(resp.Header.Get("Content-Range"))
			if err != nil {
				return 0, fmt.Errorf("range response from %s: %w", cur.Host, err)
			}
			if total >= 0 && total != s.size {
				return 0, fmt.Errorf("%w: size is now %d, was %d", ErrSourceChanged, total, s.size)
			}
			if a != off || b != last {
				return 0, fmt.Errorf("asked %s for bytes %d-%d, got %d-%d", cur.Host, off, last, a, b)
			}
			return s.readBody(ctx, resp.Body, p, stall)
		case resp.StatusCode == http.StatusOK:
			defer resp.Body.Close()
			// The server ignored the range. Taking the body is right only
			// when the whole file was asked for; otherwise it would cost a
			// full download, which is what this type exists to avoid.
			if off != 0 || int64(len(p)) != s.size {
				return 0, fmt.Errorf("%s ignores Range requests; refusing to download the whole file", cur.Host)
			}
			return s.readBody(ctx, resp.Body, p, stall)
		default:
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			err := s.statusError(resp, body)
			var se *httpStatusError
			if errors.As(err, &se) && se.transient() {
				return 0, &transientError{err}
			}
			return 0, err
		}
	}
	return 0, fmt.Errorf("more than %d redirects", maxRedirects)
}

func (s *HFSource) readBody(ctx context.Context, body io.Reader, p []byte, stall *time.Timer) (int, error) {
	done := 0
	for done < len(p) {
		n, err := body.Read(p[done:])
		done += n
		s.fetched.Add(uint64(n))
		if n > 0 {
			stall.Reset(s.stall)
		}
		if err != nil {
			if done == len(p) {
				break
			}
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return done, s.netError(ctx, err)
		}
	}
	return done, nil
}

// netError classifies a transport failure: the caller's cancellation is
// final; everything else (resets, stalls, truncated bodies, DNS hiccups) is
// retried, a bounded number of times.
func (s *HFSource) netError(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return cerr
	}
	return &transientError{fmt.Errorf("reading %s: %w", s, err)}
}

// checkETag refuses an answer for another version of the file. The hub's
// own answers carry the pinned ETag (X-Linked-Etag on redirects of LFS
// files, ETag on files it serves itself); a CDN's ETag is in its own
// format, so it is only held to the first value seen.
func (s *HFSource) checkETag(resp *http.Response, hub bool) error {
	ok2xx := resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusPartialContent
	if hub {
		got := normETag(resp.Header.Get("X-Linked-Etag"))
		if got == "" && ok2xx && !s.linkedETag {
			got = normETag(resp.Header.Get("ETag"))
		}
		if got != "" && got != s.etag {
			return fmt.Errorf("%w: %s now has ETag %s, pinned %s", ErrSourceChanged, s.ref, got, s.etag)
		}
	}
	if ok2xx && (!hub || s.linkedETag) {
		return s.checkCDNETag(resp)
	}
	return nil
}

func (s *HFSource) checkCDNETag(resp *http.Response) error {
	e := normETag(resp.Header.Get("ETag"))
	if e == "" {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cdnETag == "" {
		s.cdnETag = e
		return nil
	}
	if e != s.cdnETag {
		return fmt.Errorf("%w: %s now serves ETag %s, earlier %s", ErrSourceChanged, resp.Request.URL.Host, e, s.cdnETag)
	}
	return nil
}

// parseContentRange parses "bytes a-b/total"; total is -1 for "*".
func parseContentRange(v string) (a, b, total int64, err error) {
	rest, ok := strings.CutPrefix(v, "bytes ")
	if !ok {
		return 0, 0, 0, fmt.Errorf("bad Content-Range %q", v)
	}
	rng, tot, ok := strings.Cut(rest, "/")
	if !ok {
		return 0, 0, 0, fmt.Errorf("bad Content-Range %q", v)
	}
	as, bs, ok := strings.Cut(rng, "-")
	if !ok {
		return 0, 0, 0, fmt.Errorf("bad Content-Range %q", v)
	}
	if a, err = strconv.ParseInt(as, 10, 64); err != nil || a < 0 {
		return 0, 0, 0, fmt.Errorf("bad Content-Range %q", v)
	}
	if b, err = strconv.ParseInt(bs, 10, 64); err != nil || b < a {
		return 0, 0, 0, fmt.Errorf("bad Content-Range %q", v)
	}
	total = -1
	if tot != "*" {
		if total, err = strconv.ParseInt(tot, 10, 64); err != nil || total <= b {
			return 0, 0, 0, fmt.Errorf("bad Content-Range %q", v)
		}
	}
	return a, b, total, nil
}
