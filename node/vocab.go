package node

import (
	"context"
	"sync"

	"github.com/meshnode/meshnode/node/sample"
)

// vocabCache holds each model's token texts, read from its tokenizer the
// first time a sequence asks for JSON output (a last stage masks the
// tokens that would break it), and kept for the node's life.
type vocabCache struct {
	mu sync.Mutex
	m  map[string]*lazyVocab // by model ID
}

type lazyVocab struct {
	once sync.Once
	v    *sample.Vocab
	err  error
}

// of is the vocabulary getter of mm, for pipeline.ServerConfig.Vocab and
// scheduler.Local.
func (c *vocabCache) of(mm *meshModel) func() (*sample.Vocab, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]*lazyVocab{}
	}
	lv, ok := c.m[mm.ref.ID]
	if !ok {
		lv = &lazyVocab{}
		c.m[mm.ref.ID] = lv
	}
	return func() (*sample.Vocab, error) {
		lv.once.Do(func() { lv.v, lv.err = loadVocab(mm) })
		return lv.v, lv.err
	}
}

// loadVocab reads the texts of a model's tokens with its tokenizer.
func loadVocab(mm *meshModel) (*sample.Vocab, error) {
	var (
		tok tokenizer
		err error
	)
	if mm.st != nil {
		tok, _, err = loadHFTokenizer(mm.st.files(context.Background()))
	} else {
		tok, _, err = loadGGUFTokenizer(mm.header)
	}
	if err != nil {
		return nil, err
	}
	return sample.NewVocab(mm.info.Vocab,
		func(id int32) (string, error) { return tok.Decode([]int32{id}) },
		tok.IsSpecial, tok.IsEOG)
}
