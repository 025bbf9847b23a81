package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// The JSON shapes of tokenizer.json that Load reads. Fields it does not know are ignored, as
// Hugging Face's loader ignores them (the decoder, for one: Load only encodes).
type addedTokenJSON struct {
	ID         uint32 `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized *bool  `json:"normalized"`
	Special    bool   `json:"special"`
}

type modelJSON struct {
	Type                    string            `json:"type"`
	Dropout                 *float64          `json:"dropout"`
	UnkToken                *string           `json:"unk_token"`
	ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
	FuseUnk                 *bool             `json:"fuse_unk"`
	ByteFallback            *bool             `json:"byte_fallback"`
	IgnoreMerges            *bool             `json:"ignore_merges"`
	Vocab                   map[string]uint32 `json:"vocab"`
	Merges                  json.RawMessage   `json:"merges"`
}

// component is a normalizer, pre-tokenizer or post-processor: its type and its raw fields.
type component map[string]json.RawMessage

func (c component) typ() string {
	var s string
	_ = json.Unmarshal(c["type"], &s)
	return s
}

func (c component) get(key string, v any) error {
	raw, ok := c[key]
	if !ok || string(raw) == "null" {
		return nil
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return fmt.Errorf("%s.%s: %w", c.typ(), key, err)
	}
	return nil
}

// The Split patterns Load implements by hand (pretokenize.go). They are compared as exact
// strings: any other pattern is refused, since a general regular-expression engine would have to
// reproduce Oniguruma's semantics exactly to give the same token ids.
const (
	// patternLlama3 is the Split pattern of Llama 3, 3.1, 3.2 and 3.3 (and tiktoken's cl100k).
	patternLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// patternQwen2 is the Split pattern of Qwen 2, 2.5 and 3: Llama 3's with single digits.
	patternQwen2 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// patternGPT2 is the pattern of the ByteLevel pre-tokenizer with use_regex (GPT-2, RoBERTa),
	// also accepted as a Split pattern.
	patternGPT2 = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// Load reads dir/tokenizer.json, a Hugging Face tokenizer, and returns a Tokenizer that encodes
// text into the same token ids. It refuses, with an error naming the part, a tokenizer.json that
// uses anything this package does not implement exactly (see the package documentation), rather
// than encode some texts differently from Hugging Face. When dir/tokenizer_config.json exists, its
// split_special_tokens is honoured as transformers honours it; nothing else in it changes how
// Hugging Face's fast tokenizers encode these models.
func Load(dir string) (*Tokenizer, error) {
	data, err := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	var cfg struct {
		SplitSpecialTokens bool `json:"split_special_tokens"`
	}
	if b, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json")); err == nil {
		if err := json.Unmarshal(b, &cfg); err != nil {
			return nil, fmt.Errorf("tokenizer: %s: %w", filepath.Join(dir, "tokenizer_config.json"), err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	t, err := parse(data, cfg.SplitSpecialTokens)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %s: %w", filepath.Join(dir, "tokenizer.json"), err)
	}
	return t, nil
}

func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || string(raw) == "null"
}

func parse(data []byte, splitSpecial bool) (*Tokenizer, error) {
	var f struct {
		Version       string           `json:"version"`
		Truncation    json.RawMessage  `json:"truncation"`
		Padding       json.RawMessage  `json:"padding"`
		AddedTokens   []addedTokenJSON `json:"added_tokens"`
		Normalizer    json.RawMessage  `json:"normalizer"`
		PreTokenizer  json.RawMessage  `json:"pre_tokenizer"`
		Model         modelJSON        `json:"model"`
		PostProcessor json.RawMessage  `json:"post_processor"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	if f.Version != "1.0" {
		return nil, fmt.Errorf("unknown tokenizer.json version %q (want \"1.0\")", f.Version)
	}
	if !isNull(f.Truncation) {
		return nil, errors.New("truncation is set: not supported (the router must see the whole prompt)")
	}
	if !isNull(f.Padding) {
		return nil, errors.New("padding is set: not supported")
	}
	t := &Tokenizer{}
	initClasses()
	if err := t.parseModel(&f.Model); err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	if err := t.parseNormalizer(f.Normalizer); err != nil {
		return nil, fmt.Errorf("normalizer: %w", err)
	}
	if err := t.parsePreTokenizer(f.PreTokenizer); err != nil {
		return nil, fmt.Errorf("pre_tokenizer: %w", err)
	}
	if err := t.parseAddedTokens(f.AddedTokens, splitSpecial); err != nil {
		return nil, fmt.Errorf("added_tokens: %w", err)
	}
	if err := t.parsePostProcessor(f.PostProcessor); err != nil {
		return nil, fmt.Errorf("post_processor: %w", err)
	}
	t.initStates()
	return t, nil
}

func (t *Tokenizer) parseModel(m *modelJSON) error {
	if m.Type != "BPE" {
		if m.Type == "" {
			return errors.New("no model type: only BPE is supported")
		}
		return fmt.Errorf("%s: only BPE is supported", m.Type)
	}
	if m.Dropout != nil && *m.Dropout != 0 {
		return fmt.Errorf("dropout %v: not supported (it makes encoding random)", *m.Dropout)
	}
	if m.ContinuingSubwordPrefix != nil && *m.ContinuingSubwordPrefix != "" {
		return fmt.Errorf("continuing_subword_prefix %q: not supported", *m.ContinuingSubwordPrefix)
	}
	if m.EndOfWordSuffix != nil && *m.EndOfWordSuffix != "" {
		return fmt.Errorf("end_of_word_suffix %q: not supported", *m.EndOfWordSuffix)
	}
	if len(m.Vocab) == 0 {
		return errors.New("empty vocab")
	}
	t.ignoreMerges = m.IgnoreMerges != nil && *m.IgnoreMerges
	t.fuseUnk = m.FuseUnk != nil && *m.FuseUnk
	t.vocab = m.Vocab
	t.vocabSize = len(m.Vocab)
	t.unkID = -1
	if m.UnkToken != nil {
		id, ok := m.Vocab[*m.UnkToken]
		if !ok {
			return fmt.Errorf("unk_token %q is not in the vocab", *m.UnkToken)
		}
		t.unkID = int64(id)
	}

	// The byte-level alphabet: every byte's one-character token. A byte whose character is not in
	// the vocab becomes the unknown token, or nothing when there is none, as in Hugging Face.
	missing := 0
	for b := 0; b < 256; b++ {
		if id, ok := m.Vocab[string(byteToRune[b])]; ok {
			t.byteID[b] = int64(id)
		} else {
			t.byteID[b] = -1
			missing++
		}
	}
	if m.ByteFallback != nil && *m.ByteFallback && missing > 0 {
		return errors.New("byte_fallback with an incomplete byte-level alphabet: not supported")
	}
	// Tokens by their bytes (the byte-level characters mapped back), for ignore_merges. A token
	// with a character outside the byte-level alphabet can never come out of a byte-level
	// pre-token, so it is left out.
	t.rawVocab = make(map[string]uint32, len(m.Vocab))
	var buf []byte
	for tok, id := range m.Vocab {
		buf = buf[:0]
		ok := true
		for _, r := range tok {
			if r >= rune(len(runeToByte)) || runeToByte[r] < 0 {
				ok = false
				break
			}
			buf = append(buf, byte(runeToByte[r]))
		}
		if ok && len(buf) > 0 {
			t.rawVocab[string(buf)] = id
		}
	}

	pairs, err := parseMerges(m.Merges)
	if err != nil {
		return err
	}
	t.merges = newMergeTable(len(pairs))
	for rank, p := range pairs {
		a, ok := m.Vocab[p[0]]
		if !ok {
			return fmt.Errorf("merge %d: %q is not in the vocab", rank, p[0])
		}
		b, ok := m.Vocab[p[1]]
		if !ok {
			return fmt.Errorf("merge %d: %q is not in the vocab", rank, p[1])
		}
		merged, ok := m.Vocab[p[0]+p[1]]
		if !ok {
			return fmt.Errorf("merge %d: %q is not in the vocab", rank, p[0]+p[1])
		}
		// A pair listed twice keeps its last rank, as Hugging Face's map of merges does.
		t.merges.put(a, b, uint32(rank), merged)
	}
	return nil
}

// parseMerges reads the merges in either of tokenizer.json's forms: ["a b", ...] (older files;
// "#version" lines skipped) or [["a", "b"], ...].
func parseMerges(raw json.RawMessage) ([][2]string, error) {
	raw = bytes.TrimSpace(raw)
	if isNull(raw) {
		return nil, errors.New("no merges")
	}
	rest := bytes.TrimSpace(raw[1:])
	if len(raw) > 0 && raw[0] == '[' && len(rest) > 0 && rest[0] == '"' {
		var lines []string
		if err := json.Unmarshal(raw, &lines); err != nil {
			return nil, fmt.Errorf("merges: %w", err)
		}
		out := make([][2]string, 0, len(lines))
		for _, l := range lines {
			if strings.HasPrefix(l, "#version") {
				continue
			}
			a, b, ok := strings.Cut(l, " ")
			if !ok || strings.Contains(b, " ") {
				return nil, fmt.Errorf("merges: line %d %q is not two tokens", len(out)+1, l)
			}
			out = append(out, [2]string{a, b})
		}
		return out, nil
	}
	var out [][2]string
	if err := json.Unmarshal(raw, &out); err != nil {
		return nil, fmt.Errorf("merges: %w", err)
	}
	return out, nil
}

func (t *Tokenizer) parseNormalizer(raw json.RawMessage) error {
	if isNull(raw) {
		return nil
	}
	var c component
	if err := json.Unmarshal(raw, &c); err != nil {
		return err
	}
	forms, err := normalizerForms(c)
	if err != nil {
		return err
	}
	t.norms = forms
	return nil
}

func normalizerForms(c component) ([]norm.Form, error) {
	switch c.typ() {
	case "NFC":
		return []norm.Form{norm.NFC}, nil
	case "NFD":
		return []norm.Form{norm.NFD}, nil
	case "NFKC":
		return []norm.Form{norm.NFKC}, nil
	case "NFKD":
		return []norm.Form{norm.NFKD}, nil
	case "Sequence":
		var subs []component
		if err := c.get("normalizers", &subs); err != nil {
			return nil, err
		}
		var out []norm.Form
		for _, s := range subs {
			f, err := normalizerForms(s)
			if err != nil {
				return nil, err
			}
			out = append(out, f...)
		}
		return out, nil
	}
	return nil, fmt.Errorf("%s: not supported (only NFC, NFD, NFKC, NFKD and a Sequence of them)", c.typ())
}

func (t *Tokenizer) parsePreTokenizer(raw json.RawMessage) error {
	if isNull(raw) {
		return errors.New("none: a byte-level BPE needs a ByteLevel pre-tokenizer")
	}
	var c component
	if err := json.Unmarshal(raw, &c); err != nil {
		return err
	}
	var list []component
	if c.typ() == "Sequence" {
		if err := c.get("pretokenizers", &list); err != nil {
			return err
		}
	} else {
		list = []component{c}
	}
	byteLevel := false
	for i, p := range list {
		if byteLevel {
			return fmt.Errorf("%s after ByteLevel: not supported", p.typ())
		}
		switch p.typ() {
		case "Split":
			var pat struct {
				Regex  *string
				String *string
			}
			var behavior string
			var invert bool
			if err := p.get("pattern", &pat); err != nil {
				return err
			}
			if err := p.get("behavior", &behavior); err != nil {
				return err
			}
			if err := p.get("invert", &invert); err != nil {
				return err
			}
			if behavior != "Isolated" || invert {
				return fmt.Errorf("Split with behavior %q, invert %v: only Isolated, not inverted, is supported", behavior, invert)
			}
			if pat.Regex == nil {
				return errors.New("Split with a String pattern: not supported")
			}
			switch *pat.Regex {
			case patternLlama3:
				t.stages = append(t.stages, stageLlama3)
			case patternQwen2:
				t.stages = append(t.stages, stageQwen2)
			case patternGPT2:
				t.stages = append(t.stages, stageGPT2)
			default:
				return fmt.Errorf("Split pattern %q: not supported (only Llama 3's, Qwen 2's and GPT-2's)", *pat.Regex)
			}
		case "ByteLevel":
			addPrefix, useRegex := true, true // Hugging Face's defaults
			if err := p.get("add_prefix_space", &addPrefix); err != nil {
				return err
			}
			if err := p.get("use_regex", &useRegex); err != nil {
				return err
			}
			if useRegex {
				t.stages = append(t.stages, stageGPT2)
			}
			t.prefixSpace = addPrefix
			t.prefixStage = len(t.stages) - boolInt(useRegex)
			byteLevel = true
		default:
			return fmt.Errorf("%s (pre-tokenizer %d): not supported", p.typ(), i)
		}
	}
	if !byteLevel {
		return errors.New("no ByteLevel pre-tokenizer: only byte-level BPE is supported")
	}
	return nil
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (t *Tokenizer) parseAddedTokens(list []addedTokenJSON, splitSpecial bool) error {
	// Hugging Face re-adds the tokens when it loads the file: a content already known (the model
	// vocab or an earlier added token) keeps that id, a new one gets the next id after the vocab.
	// The file's ids are what the JavaScript tokenizer uses; refuse a file where they disagree.
	added := make(map[string]uint32)
	next := uint32(t.vocabSize)
	var raw, normed []addedToken
	for _, a := range list {
		if a.Content == "" {
			continue
		}
		if !utf8.ValidString(a.Content) {
			return fmt.Errorf("token %d is not valid UTF-8", a.ID)
		}
		id, ok := added[a.Content]
		if !ok {
			id, ok = t.vocab[a.Content]
		}
		if !ok {
			id = next
			next++
		}
		if id != a.ID {
			return fmt.Errorf("token %q has id %d, but Hugging Face's Rust tokenizer would give it %d", a.Content, a.ID, id)
		}
		added[a.Content] = id
		normalized := !a.Special // Hugging Face's default
		if a.Normalized != nil {
			normalized = *a.Normalized
		}
		tok := addedToken{content: a.Content, id: id, singleWord: a.SingleWord, lstrip: a.LStrip, rstrip: a.RStrip}
		if splitSpecial && a.Special {
			// split_special_tokens: special tokens in the text are encoded as text, but the
			// post-processor still adds them.
			continue
		}
		if normalized && len(t.norms) > 0 {
			tok.content = t.normalize(tok.content)
			normed = append(normed, tok)
		} else if normalized {
			normed = append(normed, tok)
		} else {
			raw = append(raw, tok)
		}
	}
	t.added = added
	t.rawAdded = newAddedMatcher(raw)
	t.normAdded = newAddedMatcher(normed)
	return nil
}

func (t *Tokenizer) parsePostProcessor(raw json.RawMessage) error {
	if isNull(raw) {
		return nil
	}
	var c component
	if err := json.Unmarshal(raw, &c); err != nil {
		return err
	}
	return t.postProcessor(c)
}

func (t *Tokenizer) postProcessor(c component) error {
	switch c.typ() {
	case "ByteLevel":
		return nil // it only moves offsets
	case "Sequence":
		var subs []component
		if err := c.get("processors", &subs); err != nil {
			return err
		}
		for _, s := range subs {
			if err := t.postProcessor(s); err != nil {
				return err
			}
		}
		return nil
	case "TemplateProcessing":
		if t.templated {
			return errors.New("two TemplateProcessing post-processors: not supported")
		}
		t.templated = true
		var single []struct {
			SpecialToken *struct{ ID string } `json:"SpecialToken"`
			Sequence     *struct{ ID string } `json:"Sequence"`
		}
		var specials map[string]struct {
			IDs []uint32 `json:"ids"`
		}
		if err := c.get("single", &single); err != nil {
			return err
		}
		if err := c.get("special_tokens", &specials); err != nil {
			return err
		}
		seen := false
		for _, item := range single {
			switch {
			case item.Sequence != nil:
				if item.Sequence.ID != "A" || seen {
					return fmt.Errorf("TemplateProcessing single template with sequence %q: only one A is supported", item.Sequence.ID)
				}
				seen = true
			case item.SpecialToken != nil:
				sp, ok := specials[item.SpecialToken.ID]
				if !ok {
					return fmt.Errorf("TemplateProcessing: special token %q is not in special_tokens", item.SpecialToken.ID)
				}
				if seen {
					t.suffix = append(t.suffix, sp.IDs...)
				} else {
					t.prefix = append(t.prefix, sp.IDs...)
				}
			default:
				return errors.New("TemplateProcessing: an item that is neither SpecialToken nor Sequence")
			}
		}
		if !seen {
			return errors.New("TemplateProcessing single template without the sequence A")
		}
		return nil
	}
	return fmt.Errorf("%s: not supported (only TemplateProcessing, ByteLevel and a Sequence of them)", c.typ())
}
