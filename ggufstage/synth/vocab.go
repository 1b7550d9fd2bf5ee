package synth

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"unicode/utf8"
)

// Token types as llama.cpp numbers them in tokenizer.ggml.token_type.
const (
	tokNormal  int32 = 1
	tokUnknown int32 = 2
	tokControl int32 = 3
	tokByte    int32 = 6
)

// vocab is a complete tokenizer description, ready for the GGUF metadata.
type vocab struct {
	tokens []string
	types  []int32
	scores []float32 // SentencePiece only
	merges []string  // byte-level BPE only

	bos, eos, unk, pad uint32
	eosIDs             []int32
}

// commonWords seeds the subword training. Order is rough frequency: earlier
// words get more weight, so frequent words become single tokens first.
const commonWords = `the of and to a in is it you that he was for on are with as
i his they be at one have this from or had by hot word but what some we can out
other were all there when up use your how said an each she which do their time if
will way about many then them write would like so these her long make thing see him
two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every good me
give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three
want air well also play small end put home read hand port large spell add even land
here must big high such follow act why ask men change went light kind off need house
picture try us again animal point mother world near build self earth father head
stand own page should country found answer school grow study still learn plant cover
food sun four between state keep eye never last let thought city tree cross farm hard
start might story saw far sea draw left late run while press close night real life
few north open seem together next white children begin got walk example ease paper
group always music those both mark often letter until mile river car feet care second
book carry took science eat room friend began idea fish mountain stop once base hear
horse cut sure watch color face wood main enough plain girl usual young ready above
ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship
area half rock order fire south problem piece told knew pass since top whole king
space heard best hour better true during hundred five remember step early hold west
ground interest reach fast verb sing listen six table travel less morning ten simple
several vowel toward war lay against pattern slow center love person money serve
appear road map rain rule govern pull cold notice voice unit power town fine certain
fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green quick
develop ocean warm free minute strong special mind behind clear tail produce fact
street inch multiply nothing course stay wheel full force blue object decide surface
deep moon island foot system busy test record boat common gold possible plane stead
dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire
bring yes distant fill east paint language among model layer token network compute
memory tensor weight stage node mesh batch cache vector matrix signal`

// chatTemplateQwen25 is the ChatML template that Qwen2.5 instruct models ship.
const chatTemplateQwen25 = `{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
`

// chatTemplateLlama2 is a minimal [INST] template in the Llama 2 chat style.
const chatTemplateLlama2 = `{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = '' %}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system %}
            {{- bos_token + '[INST] <<SYS>>\n' + system + '\n<</SYS>>\n\n' + message['content'] | trim + ' [/INST]' }}
        {%- else %}
            {{- bos_token + '[INST] ' + message['content'] | trim + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] | trim + ' ' + eos_token }}
    {%- endif %}
{%- endfor %}
`

const (
	spmSpace = "▁" // SentencePiece word-boundary marker
	bpeSpace = "Ġ" // GPT-2 byte-level image of ' '

	// vocabSeed fixes the filler tokens: the tokenizer depends only on the
	// family and the vocabulary size, never on Spec.Seed, so that files of
	// one shape share token ids.
	vocabSeed = 0x5eed7f0c

	maxFillerRunes = 12
)

// Minimum vocabulary sizes: what each family needs before any merge.
const (
	minVocabSPM = 3 + 256 + 95 // specials, byte fallback, printable ASCII and ▁
	minVocabBPE = 256 + 3      // byte symbols, specials
)

var vocabCache sync.Map // vocabKey -> *vocab

type vocabKey struct {
	bpe  bool
	size int
}

// getVocab builds (once per family and size) the tokenizer for a spec.
func getVocab(bpe bool, size int) (*vocab, error) {
	key := vocabKey{bpe, size}
	if v, ok := vocabCache.Load(key); ok {
		return v.(*vocab), nil
	}
	var v *vocab
	var err error
	if bpe {
		v, err = buildBPE(size)
	} else {
		v, err = buildSPM(size)
	}
	if err != nil {
		return nil, err
	}
	actual, _ := vocabCache.LoadOrStore(key, v)
	return actual.(*vocab), nil
}

// byteSymbols returns GPT-2's byte-to-unicode table: printable bytes stand for
// themselves and the rest are shifted past U+0100, in the order GPT-2 lists
// them (printable ranges first), which is also the order of the base tokens.
func byteSymbols() (order []byte, sym [256]string) {
	printable := func(b int) bool {
		return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)
	}
	for b := range 256 {
		if printable(b) {
			order = append(order, byte(b))
			sym[b] = string(rune(b))
		}
	}
	n := 0
	for b := range 256 {
		if !printable(b) {
			order = append(order, byte(b))
			sym[b] = string(rune(256 + n))
			n++
		}
	}
	return order, sym
}

// corpus returns the training words split into single-rune symbols with
// Zipf-like weights, in the variants a tokenizer sees in running text.
func corpus(space string) (words [][]string, weights []int) {
	seen := map[string]bool{}
	add := func(s string, w int) {
		if seen[s] {
			return
		}
		seen[s] = true
		var syms []string
		for _, r := range s {
			syms = append(syms, string(r))
		}
		// The space marker belongs to the word it precedes, as in both
		// SentencePiece and GPT-2 vocabularies.
		if strings.HasPrefix(s, space) {
			syms = append([]string{space}, syms[utf8.RuneCountInString(space):]...)
		}
		words = append(words, syms)
		weights = append(weights, w)
	}
	for rank, w := range strings.Fields(commonWords) {
		weight := 100000 / (rank + 10)
		title := strings.ToUpper(w[:1]) + w[1:]
		add(space+w, weight)
		add(w, weight/3+1)
		add(title, weight/4+1)
		add(space+title, weight/8+1)
	}
	return words, weights
}

// trainMerges runs byte-pair training on the corpus until it has produced n
// new tokens or every word is a single symbol. Ties break on the pair's text
// so the result is deterministic. Two merges can spell the same token, so
// merges and new tokens are returned separately; known gains the new tokens.
// Pair counts are updated incrementally: only words holding the merged pair
// are recounted, which keeps a full run over the corpus well under a second.
func trainMerges(text [][]string, weights []int, known map[string]bool, n int) (merges [][2]string, toks []string) {
	var names []string
	ids := map[string]int32{}
	intern := func(s string) int32 {
		if id, ok := ids[s]; ok {
			return id
		}
		ids[s] = int32(len(names))
		names = append(names, s)
		return ids[s]
	}
	key := func(a, b int32) uint64 { return uint64(a)<<32 | uint64(uint32(b)) }

	words := make([][]int32, len(text))
	counts := map[uint64]int{}
	where := map[uint64][]int{} // words that held the pair at some point
	count := func(i, sign int) {
		w := words[i]
		for j := 0; j+1 < len(w); j++ {
			k := key(w[j], w[j+1])
			counts[k] += sign * weights[i]
			if sign > 0 {
				where[k] = append(where[k], i)
			}
		}
	}
	for i, w := range text {
		for _, s := range w {
			words[i] = append(words[i], intern(s))
		}
		count(i, 1)
	}

	visited := make([]int, len(words)) // last merge that rewrote each word
	for step := 1; len(toks) < n; step++ {
		var best uint64
		bestN := 0
		for k, c := range counts {
			if c <= 0 {
				continue
			}
			if c > bestN || (c == bestN && cmp.Or(
				strings.Compare(names[k>>32], names[best>>32]),
				strings.Compare(names[uint32(k)], names[uint32(best)])) < 0) {
				best, bestN = k, c
			}
		}
		if bestN == 0 {
			break
		}
		a, b := int32(best>>32), int32(uint32(best))
		joined := names[a] + names[b]
		m := intern(joined)
		merges = append(merges, [2]string{names[a], names[b]})
		if !known[joined] {
			known[joined] = true
			toks = append(toks, joined)
		}
		for _, i := range where[best] {
			if visited[i] == step {
				continue
			}
			visited[i] = step
			count(i, -1)
			w := words[i]
			out := w[:0]
			for j := 0; j < len(w); j++ {
				if j+1 < len(w) && w[j] == a && w[j+1] == b {
					out = append(out, m)
					j++
					continue
				}
				out = append(out, w[j])
			}
			words[i] = out
			count(i, 1)
		}
		delete(counts, best)
		delete(where, best)
	}
	return merges, toks
}

// extend adds tokens (and the merges that spell them) until there are n new
// tokens. Past the trained ones it joins random existing tokens, a
// word-boundary token only in front, so big vocabularies like 32000 or 128256
// get plausible, unique filler pieces.
func extend(merges [][2]string, toks []string, known map[string]bool, letters []string, space string, n int) ([][2]string, []string) {
	rng := rand.New(rand.NewPCG(vocabSeed, uint64(n)))
	var pool, tails []string
	grow := func(s string) {
		// Lowercase only, so fillers read like word pieces, not CamelCase.
		body := strings.TrimPrefix(s, space)
		if strings.ContainsFunc(body, func(r rune) bool { return r < 'a' || r > 'z' }) {
			return
		}
		// Only short pieces are extended further, so a join never passes
		// the length cap and filler stays near real subword lengths.
		if utf8.RuneCountInString(body) > maxFillerRunes/2 {
			return
		}
		pool = append(pool, s)
		if body == s {
			tails = append(tails, s)
		}
	}
	for _, s := range letters {
		grow(s)
	}
	for _, s := range toks {
		grow(s)
	}
	for len(toks) < n {
		a, b := pick(rng, pool), pick(rng, tails)
		s := a + b
		if known[s] {
			continue
		}
		known[s] = true
		merges = append(merges, [2]string{a, b})
		toks = append(toks, s)
		grow(s)
	}
	return merges, toks
}

// pick returns the shorter of two random entries, biasing filler toward
// short pieces as real vocabularies are.
func pick(rng *rand.Rand, from []string) string {
	a, b := from[rng.IntN(len(from))], from[rng.IntN(len(from))]
	if len(b) < len(a) {
		return b
	}
	return a
}

// lowercase is the word-boundary marker and a-z: what filler tokens grow from.
func lowercase(space string) []string {
	out := []string{space}
	for c := 'a'; c <= 'z'; c++ {
		out = append(out, string(c))
	}
	return out
}

// buildSPM makes a Llama-style SentencePiece vocabulary: <unk> <s> </s>, the
// 256 byte-fallback pieces, merged pieces scored by merge order, and the
// single characters last, as Llama 2's tokenizer.model lays them out.
func buildSPM(size int) (*vocab, error) {
	if size < minVocabSPM {
		return nil, fmt.Errorf("synth: llama vocabulary needs at least %d tokens, got %d", minVocabSPM, size)
	}
	chars := []string{spmSpace}
	for c := '!'; c <= '~'; c++ {
		chars = append(chars, string(c))
	}
	v := &vocab{bos: 1, eos: 2, unk: 0}
	add := func(tok string, typ int32, score float32) {
		v.tokens = append(v.tokens, tok)
		v.types = append(v.types, typ)
		v.scores = append(v.scores, score)
	}
	add("<unk>", tokUnknown, 0)
	add("<s>", tokControl, 0)
	add("</s>", tokControl, 0)
	for b := range 256 {
		add(fmt.Sprintf("<0x%02X>", b), tokByte, 0)
	}

	n := size - len(v.tokens) - len(chars)
	known := map[string]bool{}
	for _, c := range chars {
		known[c] = true
	}
	words, weights := corpus(spmSpace)
	merges, toks := trainMerges(words, weights, known, n)
	_, toks = extend(merges, toks, known, lowercase(spmSpace), spmSpace, n)
	// Scores rank pieces by creation order, so the encoder's highest-score
	// first merging replays the training order.
	for i, s := range toks {
		add(s, tokNormal, -float32(i))
	}
	for i, c := range chars {
		add(c, tokNormal, -float32(len(toks)+i))
	}
	return v, nil
}

// buildBPE makes a Qwen2-style byte-level BPE vocabulary: the 256 byte
// symbols, tokens produced by the merges in rank order, then the control
// tokens, which Qwen places after the regular vocabulary.
func buildBPE(size int) (*vocab, error) {
	if size < minVocabBPE {
		return nil, fmt.Errorf("synth: gpt2 vocabulary needs at least %d tokens, got %d", minVocabBPE, size)
	}
	order, sym := byteSymbols()
	v := &vocab{}
	known := map[string]bool{}
	for _, b := range order {
		v.tokens = append(v.tokens, sym[b])
		v.types = append(v.types, tokNormal)
		known[sym[b]] = true
	}

	n := size - len(v.tokens) - 3
	words, weights := corpus(bpeSpace)
	merges, toks := trainMerges(words, weights, known, n)
	merges, toks = extend(merges, toks, known, lowercase(bpeSpace), bpeSpace, n)
	for _, s := range toks {
		v.tokens = append(v.tokens, s)
		v.types = append(v.types, tokNormal)
	}
	for _, m := range merges {
		v.merges = append(v.merges, m[0]+" "+m[1])
	}

	endOfText := uint32(len(v.tokens))
	for _, s := range []string{"<|endoftext|>", "<|im_start|>", "<|im_end|>"} {
		v.tokens = append(v.tokens, s)
		v.types = append(v.types, tokControl)
	}
	imEnd := endOfText + 2
	v.bos, v.eos, v.pad = endOfText, imEnd, endOfText
	v.eosIDs = []int32{int32(imEnd), int32(endOfText)}
	return v, nil
}
