// Package tokenizer encodes text into token ids exactly as Hugging Face's tokenizer does, from
// the model's tokenizer.json, so that the endpoint picker routes a text prompt on the same token
// ids (and so the same KV blocks) as the engine that will serve it.
//
// Use it as
//
//	tk, err := tokenizer.Load("/models/llama-3.1") // once per model; safe for concurrent use
//	ids := tk.Encode(prompt, true)                 // add_special_tokens, as vLLM's completions
//
// # Why not a library
//
// The Go tokenizer libraries this project could use either wrap the Rust library through cgo
// (daulet/tokenizers: a C toolchain and a prebuilt archive per platform in every build, which the
// static, cgo-free binary gives up) or reimplement it in Go without matching it (sugarme/tokenizer
// splits with Go's regexp, which has no lookahead, so its byte-level pattern leaves out the
// `\s+(?!\S)` that GPT-2's, Llama 3's and Qwen's patterns have, and runs of spaces before a word
// tokenize differently; tiktoken-go reads tiktoken files, not tokenizer.json). A byte-level BPE
// is small, and what the router needs is exactness, so this package implements the part of
// Hugging Face's pipeline these models use and refuses, at Load, every tokenizer.json that needs
// anything else.
//
// # What is implemented
//
//   - Model: BPE with merges in either form, ignore_merges (Llama 3), unk_token and fuse_unk;
//     dropout, continuing_subword_prefix and end_of_word_suffix are refused.
//   - Normalizer: none, NFC, NFD, NFKC, NFKD, or a Sequence of them (Qwen 3 uses NFC). Go's
//     norm package follows a newer Unicode than the Rust library in one place, which is undone
//     (see composeExceptDivesAkuru).
//   - Pre-tokenizer: ByteLevel (add_prefix_space, use_regex), alone or after a Split (Isolated)
//     whose pattern is Llama 3's, Qwen 2's (and 3's) or GPT-2's, matched by hand-written scanners
//     with the regular expressions' semantics (pretokenize.go). Any other pattern is refused: a
//     general regular-expression engine would have to reproduce Oniguruma's exactly. The
//     character classes \p{L}, \p{N} and \s are the Rust library's, probed code point by code
//     point (unicode_tables.go), not Go's, which follow another Unicode version.
//   - Added tokens: matched leftmost-longest in the text as given (special, not normalized) or
//     in the normalized text (normalized), with single_word, lstrip and rstrip; a file whose ids
//     disagree with the ids the Rust library would assign is refused. tokenizer_config.json's
//     split_special_tokens is honoured.
//   - Post-processor: TemplateProcessing's single template (Llama's <|begin_of_text|>), ByteLevel,
//     or a Sequence of them; Encode's addSpecialTokens adds what it adds.
//   - Truncation and padding must be off: the router needs the whole prompt.
//
// # Exactness
//
// testdata/goldens-*.json are written by scripts/goldens/gen-tokenizer-goldens.mjs with Hugging
// Face's JavaScript tokenizer (@huggingface/transformers) and its Rust one (the `tokenizers`
// Node binding of the library that transformers and vLLM run), for Llama 3.1 and Qwen 3 and for
// variants of them that exercise the other options: code, JSON, CRLF, numbers, contractions,
// every script, emoji, combining marks, unnormalized text, special tokens written in the text,
// rendered chat prompts, 220 KB texts, and a sweep over every Unicode code point. Where the two
// references disagree, the Go tokenizer matches the Rust one, which is what the engine runs.
//
// # Cost
//
// Each call borrows a per-CPU word cache (bounded: 16 Ki words, about 2.5 MB per slot), so
// repeated words are merged once; a word the cache has not seen is merged with a quadratic scan
// when short and a heap when long, so a 220 KB word without spaces costs tens of milliseconds,
// not minutes. docs/BENCHMARKS.md has the figures.
package tokenizer
