// Package chattemplate renders a model's Hugging Face chat template (Jinja) for an OpenAI chat
// request, producing the prompt text vLLM renders for it, byte for byte, so that the endpoint
// picker tokenizes the same token ids as the engine and routes on the engine's prefix cache.
//
// Use it as
//
//	tmpl, err := chattemplate.Load(".../llama-3.1") // once per model; safe for concurrent use
//	prompt, err := tmpl.Render(msgs, chattemplate.Options{AddGenerationPrompt: true, Tools: tools,
//		Extra: chatTemplateKwargs})
//
// and tokenize the prompt without adding special tokens (the template writes them: Llama's
// begins with bos_token), as vLLM does for chat requests.
//
// # What is reproduced
//
// vLLM renders with Python: its chat_utils turns the request into a conversation and transformers'
// apply_chat_template renders it with jinja2 in an ImmutableSandboxedEnvironment(trim_blocks=True,
// lstrip_blocks=True, loopcontrols) whose tojson is json.dumps(ensure_ascii=False), with
// raise_exception and strftime_now as globals and the special tokens as variables. This package
// mirrors both halves:
//
//   - The conversation (messageValue in template.go, values.go): role and content; an assistant's tool_calls
//     with each function's arguments parsed from their JSON string (invalid JSON, or none, is {},
//     as in vLLM) and its reasoning as both reasoning and reasoning_content; a tool message's
//     tool_call_id; the name. Content follows vLLM's content format, which vLLM detects per
//     template: "string" (a list of parts is its text parts joined by "\n", null is "") unless the
//     template loops over message content, then "openai" (a list of {"type": "text", "text": ...}
//     and {"type": "image"}-like placeholders); a tool message whose parts are all text is a
//     string either way. Media parts cannot render exactly in the string format (vLLM inserts the
//     model's placeholders and its multimodal processor expands them), so they are an error there.
//   - The tools: what vLLM passes is its request model's model_dump(): {"type": "function",
//     "function": {"name", "description", "parameters", ...extra}, ...extra}, with description and
//     parameters null when absent. Templates print them with tojson, so the order and the nulls
//     matter.
//   - The template variables: messages, tools (None without tools), documents (None),
//     add_generation_prompt, the special tokens the tokenizer has (bos_token, eos_token, ...),
//     and chat_template_kwargs (Options.Extra). A tokenizer with several templates renders
//     "tool_use" when the request has tools and "default" otherwise, as transformers picks them.
//
// # The Jinja implementation
//
// Rendering uses github.com/ardanlabs/jinja (v1.8.0, the newest that builds with Go 1.26), a
// pure-Go Jinja built for LLM chat templates: it has the Python string methods templates call
// (startswith, split, strip with an argument, ...), namespace(), slices with steps
// (messages[::-1]), loop variables, loop controls, macros, and — what decides it — an ordered
// dict, so that tojson and items() show keys in the order the client sent them, as Python does.
// Unpatched, it renders every golden case below exactly.
//
// The alternative, github.com/nikolalohinski/gonja/v2 (v2.9.1), renders the Llama 3.1 goldens
// and the Qwen 3 goldens without tools exactly, but none with tools: its tojson is Go's
// encoding/json (no spaces after separators, HTML escaping of <, > and &) and its values are Go
// maps, so keys come out sorted; fixing that means replacing its value model, not a filter.
//
// Where ardanlabs/jinja differs from jinja2 in ways the goldens cannot show (the JavaScript
// reference differs there too), this package rewrites the template before compiling it
// (rewrite.go) and supplies Python's functions (python.go):
//
//   - Whitespace control: the library trims the text beside a block tag even when an expression
//     stands between them ({% for %}{{ x }}\n{% endfor %} loses the newline) and the text before
//     a tag's "-" even past other tags, and does not drop the template's trailing newline. The
//     rewrite applies jinja2's lexer rules itself ("-" and "+" markers, trim_blocks,
//     lstrip_blocks, keep_trailing_newline=False, newlines normalised) and hands the library no
//     text to trim (each piece of text becomes a printed string literal).
//   - String literals: the library unescapes only \n, \t, \\, \' and \"; the rewrite decodes
//     Python's escapes (\r, \v, \xhh, \uXXXX, octal, ...).
//   - tojson: transformers' json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//     sort_keys=False), every option honoured; floats as Python's repr (1.0, 1e-05, 1e+16,
//     1000000000000000.0 — the library writes 1, and Go's encoding/json 1e+15); U+2028 and U+2029
//     unescaped (Go escapes them).
//   - trim and strip()/lstrip()/rstrip() without arguments: Python's whitespace (str.isspace,
//     which includes U+001C..U+001F and not U+FEFF); the library's lstrip and rstrip strip only
//     " \t\n\r".
//   - Printing: {{ x }} and the string filter write Python's str(x) (None, 1.0, True, and lists
//     and dicts as their repr); the library writes None as "" and floats with Go's %g.
//   - raise_exception returns an *Exception carrying the template's message; strftime_now
//     formats with Python's (C's) directives on Options.Now; range is Python's.
//   - A panic in the library (strings.Repeat with a negative count, for one) is recovered into an
//     error, at compile and at render.
//
// # Exactness, and the references
//
// testdata/llama-3.1.golden.json and testdata/qwen3.golden.json are written by
// scripts/goldens/gen-chat-goldens.mjs with Hugging Face's JavaScript apply_chat_template
// (@huggingface/transformers 4.3.2, @huggingface/jinja 0.5.13), the official implementation we can
// run here; testdata/crosscheck_jinja2.py renders the same cases with Python's jinja2 in
// transformers' environment (transformers itself does not install here) and finds them all
// identical. That script also writes testdata/python.golden.json: the cases where
// @huggingface/jinja and jinja2 disagree, where vLLM's jinja2 is the one to match — JavaScript's
// strip(chars), lstrip(chars) and rstrip(chars) ignore their argument and strip all whitespace
// (Qwen 3's content.lstrip('\n') would eat an answer's indentation), its trim strips U+FEFF but
// not U+001C..U+001F or U+0085, and its tojson writes the float 1.0 as 1.
//
// Known differences from jinja2, none of which the two models' templates reach:
//
//   - Undefined values are lenient: an attribute of an undefined value, or adding to one, is
//     undefined rather than jinja2's UndefinedError, so a conversation vLLM refuses with HTTP 400
//     may render here (and be routed).
//   - Concatenating a non-string with ~ or + uses the library's formatting: 'a' ~ None is "a"
//     (Python "aNone") and 'a' ~ 1.0 is "a1" (Python "a1.0"). Printing is exact.
//   - An integer beyond int64 is a float here (Python ints are unbounded); JSON nested deeper
//     than 512 levels is refused in tools (and is {} in tool call arguments); vLLM accepts up to
//     Python's recursion limit.
//   - The content format is detected from the source (a `for ... in message.content` or
//     message['content'] loop), where vLLM walks the syntax tree and also follows variables set
//     from the content; Options.ContentFormat overrides it.
//   - A request's reasoning_content of "" counts as none (vLLM would set it to ""), and a null
//     content is "" in the "openai" format too (vLLM gives []).
//   - \N{name} escapes in string literals are not decoded; the sandbox (which refuses calls to
//     unsafe attributes) has no counterpart, as the library exposes no Python objects.
//
// # Cost and its bounds
//
// Rendering is linear in the conversation for both templates: 0.6 ms for 220 KB on this 2-core
// machine (BenchmarkRender). A template is operator configuration and is trusted; the messages
// are the client's and only data: content is never parsed as a template, and every loop of a
// template runs over values (messages, tools, strings) whose size the request already bounds.
// Bounded here: how deeply request JSON nests (512 levels: decoding, tojson and recursive macros
// walk it), and range() (1 Mi items; the library builds a list, not a lazy range). Not bounded,
// because the library has no step, output or time budget: a template's own loops and recursive
// macros, and string repetition ('x' * n) — a template that does these on content size could
// cost that much, so only use templates that come from the model. The caller bounds the body
// size.
package chattemplate
