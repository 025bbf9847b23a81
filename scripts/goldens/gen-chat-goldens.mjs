// gen-chat-goldens.mjs writes the chat template goldens of server/frontdoor/chattemplate: for each
// model of .tmp/models (scripts/models.sh), the prompt Hugging Face's own JavaScript library
// (@huggingface/transformers, whose apply_chat_template renders with @huggingface/jinja) renders
// for each case below with tokenize=false, into
// server/frontdoor/chattemplate/testdata/<model>.golden.json. The Go tests read only those files;
// this script is never run by them.
//
// Run it from the repository root, after installing the pinned library into the git-ignored
// .tmp/goldens (reuse it when it already has node_modules):
//
//   scripts/models.sh
//   mkdir -p .tmp/goldens && cp scripts/goldens/package*.json .tmp/goldens/ &&
//     (cd .tmp/goldens && npm ci --ignore-scripts --no-audit --no-fund)
//   node scripts/goldens/gen-chat-goldens.mjs
//
// Each case is an OpenAI chat request (messages, tools, chat_template_kwargs,
// add_generation_prompt). Before rendering, the script turns the request into what the template is
// given the way vLLM does (vllm/entrypoints/chat_utils.py, "string" content format, and
// `tool.model_dump()` of its request model), since vLLM's prompt is what the router must
// reproduce; the Go package does the same (template.go, values.go), and these goldens check both halves.
// Cases whose conversation is large are stored as a recipe ("synthetic", rebuilt by the Go tests
// with the same formula as synthText below) and the expected prompt as its sha256 and byte length.
//
// vLLM renders with Python's jinja2, not this library. server/frontdoor/chattemplate/testdata/
// crosscheck_jinja2.py renders these same cases with jinja2 in transformers' environment and
// checks that they agree; where the two libraries disagree (str.strip with an argument, the
// whitespace of trim, floats in tojson), no case here depends on it, and that script writes
// jinja2's own goldens (python.golden.json) for the Go tests.
import { createRequire } from "node:module";
import { createHash } from "node:crypto";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const require = createRequire(path.join(repo, ".tmp/goldens/package.json"));
const { AutoTokenizer, env } = await import(require.resolve("@huggingface/transformers"));
const nodeModules = path.join(repo, ".tmp/goldens/node_modules");
const versionOf = (pkg) => JSON.parse(fs.readFileSync(path.join(nodeModules, pkg, "package.json"), "utf8")).version;
const transformersVersion = versionOf("@huggingface/transformers");
const jinjaVersion = versionOf("@huggingface/jinja");

const modelsDir = process.env.KVROUTER_MODELS || path.join(repo, ".tmp/models");
env.allowRemoteModels = false;
env.localModelPath = modelsDir + path.sep;
const outDir = path.join(repo, "server/frontdoor/chattemplate/testdata");

// Above this many bytes a golden stores the prompt's sha256 and length instead of the prompt.
const inlineLimit = 16 << 10;

// synthWords and synthText are the deterministic filler of the synthetic cases; the Go tests
// (synth_test.go) build the same text. Lines mix ASCII, accents, combining marks, CJK, emoji and
// Jinja-looking text so that large prompts exercise the same paths as small ones.
const synthWords = [
  "alpha", "héllo", "wörld", "世界", "你好", "🙂", "👩‍👩‍👧", "e\u0301", "naïve", "Ω",
  "{{ x }}", "{% if y %}", "quote\"d", "back\\slash", "tab\there", "<b>&amp;</b>",
];

function synthText(seed, lines) {
  let s = "";
  for (let i = 0; i < lines; i++) {
    const a = synthWords[(i * 7 + seed) % synthWords.length];
    const b = synthWords[(i * 3 + seed * 5) % synthWords.length];
    s += `${seed}.${i} ${a} lorem ipsum dolor sit amet ${b} consectetur\n`;
  }
  return s;
}

// synthMessages builds the synthetic conversation: an optional system message, then `turns`
// messages alternating user and assistant, each of `lines` lines.
function synthMessages({ turns, lines, system }) {
  const msgs = [];
  if (system) msgs.push({ role: "system", content: synthText(0, lines) });
  for (let t = 0; t < turns; t++) {
    msgs.push({ role: t % 2 === 0 ? "user" : "assistant", content: synthText(t + 1, lines) });
  }
  return msgs;
}

// ---- vLLM's request-to-template conversion (the Go side: values.go) ----

// contentText is vLLM's "string" content format: a string as is, null as "", a list of parts as
// its text parts joined by newlines.
function contentText(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  return content.map((p) => (typeof p === "string" ? p : p.text ?? p.refusal ?? p.thinking)).join("\n");
}

function conversation(messages) {
  return messages.map((m) => {
    const out = { role: m.role, content: contentText(m.content) };
    if (m.role === "assistant") {
      if (m.tool_calls && m.tool_calls.length > 0) {
        out.tool_calls = m.tool_calls.map((tc) => {
          let args = tc.function.arguments;
          if (typeof args === "string") {
            try {
              args = JSON.parse(args);
            } catch {
              args = {};
            }
          } else if (args === null || typeof args !== "object") {
            args = {};
          }
          const fn = { name: tc.function.name, arguments: args };
          const call = {};
          if (tc.id !== undefined) call.id = tc.id;
          call.type = tc.type ?? "function";
          call.function = fn;
          return call;
        });
      }
      const reasoning = m.reasoning ?? m.reasoning_content;
      if (reasoning) {
        out.reasoning = reasoning;
        out.reasoning_content = reasoning;
      }
    }
    if (m.role === "tool" && m.tool_call_id !== undefined) out.tool_call_id = m.tool_call_id;
    if (typeof m.name === "string" && m.name !== "") out.name = m.name;
    return out;
  });
}

// tool is vLLM's ChatCompletionToolsParam.model_dump(): declared fields first, in declaration
// order and with their defaults, then the extra fields in request order.
function tool(t) {
  const { type = "function", function: f, ...extra } = t;
  const { name, description = null, parameters = null, ...fextra } = f;
  return { type, function: { name, description, parameters, ...fextra }, ...extra };
}

// ---- the cases ----

const weatherTool = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Get the current weather in a city — «météo», 天气 & <units>",
    parameters: {
      type: "object",
      properties: {
        city: { type: "string", description: "The city, e.g. 'Paris'" },
        unit: { type: "string", enum: ["celsius", "fahrenheit"] },
        days: { type: "integer", minimum: 1, maximum: 14 },
      },
      required: ["city"],
    },
  },
};
const searchTool = {
  type: "function",
  function: {
    name: "search",
    parameters: { type: "object", properties: { q: { type: "string" }, limit: { type: "integer" } } },
    strict: true,
  },
};

const multiTurn = [
  { role: "system", content: "You are a terse assistant." },
  { role: "user", content: "What is 2+2?" },
  { role: "assistant", content: "4." },
  { role: "user", content: "And 3+3?" },
  { role: "assistant", content: "6." },
  { role: "user", content: "Name a prime above 10." },
  { role: "assistant", content: "11." },
  { role: "user", content: "Thanks. One more: 7*6?" },
];

const unicode =
  "CJK: 你好，世界。日本語のテキスト。한국어. Emoji: 🙂👍🏽👩‍👩‍👧🇫🇷. Combining: e\u0301 n\u0303 a\u030a\u0323. " +
  "RTL: مرحبا بالعالم. Math: ∑∫√∞ ≠ ≤. Zero-width: a\u200bb\u200dc. Astral: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈.";

const jinjaText =
  "Keep these literal: {{ x }} {{- y -}} {% if true %}yes{% endif %} {# comment #} {%- raw %}{% endraw %} " +
  "{{ messages[0]['content'] }} {% for m in messages %}{{ m }}{% endfor %} }} %} {{";

const common = [
  { name: "single_user", request: { messages: [{ role: "user", content: "Hello!" }] } },
  {
    name: "single_user_no_generation_prompt",
    request: { messages: [{ role: "user", content: "Hello!" }], add_generation_prompt: false },
  },
  {
    name: "system_and_user",
    request: {
      messages: [
        { role: "system", content: "You are a helpful assistant." },
        { role: "user", content: "Who are you?" },
      ],
    },
  },
  { name: "multi_turn", request: { messages: multiTurn } },
  {
    name: "multi_turn_ends_with_assistant_no_generation_prompt",
    request: { messages: [...multiTurn, { role: "assistant", content: "42." }], add_generation_prompt: false },
  },
  {
    name: "unicode",
    request: {
      messages: [
        { role: "system", content: "Réponds en français. 用中文回答。" },
        { role: "user", content: unicode },
        { role: "assistant", content: "D'accord — 好的 👍" },
        { role: "user", content: [...unicode].reverse().join("") },
      ],
    },
  },
  {
    name: "jinja_looking_content",
    request: {
      messages: [
        { role: "system", content: "{% set x = 1 %}{{ raise_exception('no') }}" },
        { role: "user", content: jinjaText },
        { role: "assistant", content: "{{ '}}' }} {%- endfor -%}" },
        { role: "user", content: "{{" },
      ],
    },
  },
  {
    name: "leading_and_trailing_whitespace",
    request: {
      messages: [
        { role: "system", content: "  \n\t system with spaces \t\n  " },
        { role: "user", content: "\n\n  user: indented\n    second line  \n\n" },
        { role: "assistant", content: "answer\n\n" },
        { role: "user", content: "   " },
      ],
    },
  },
  {
    name: "empty_content",
    request: { messages: [{ role: "user", content: "" }] },
  },
  {
    name: "special_token_text",
    request: {
      messages: [
        { role: "user", content: "<|im_start|>system\nfake<|im_end|> <|eot_id|><|start_header_id|>x<|end_header_id|> <think></think>" },
      ],
    },
  },
  {
    name: "content_parts",
    request: {
      messages: [
        { role: "system", content: [{ type: "text", text: "Part one." }, { type: "text", text: "Part two." }] },
        { role: "user", content: [{ type: "text", text: "Look:" }, { type: "text", text: "" }, { type: "text", text: "end" }] },
      ],
    },
  },
  {
    name: "long_single_user",
    synthetic: { turns: 1, lines: 3500, system: false },
  },
  {
    name: "long_conversation_40_turns",
    synthetic: { turns: 40, lines: 90, system: true },
  },
  {
    name: "long_conversation_no_generation_prompt",
    synthetic: { turns: 12, lines: 300, system: false },
    request: { add_generation_prompt: false },
  },
];

const toolTurns = [
  { role: "system", content: "You can call tools." },
  { role: "user", content: "Weather in Paris and Tokyo for 3 days?" },
  {
    role: "assistant",
    content: null,
    tool_calls: [
      { id: "call_1", type: "function", function: { name: "get_weather", arguments: '{"city": "Paris", "days": 3}' } },
      {
        id: "call_2",
        type: "function",
        function: {
          name: "get_weather",
          arguments: '{"city":"東京","days":3,"unit":"celsius","opts":{"hourly":false,"fields":["temp","wind"],"note":null,"delta":-2,"ratio":0.25}}',
        },
      },
    ],
  },
  { role: "tool", tool_call_id: "call_1", content: '{"temp": 18, "sky": "cloudy"}' },
  { role: "tool", tool_call_id: "call_2", content: [{ type: "text", text: '{"temp": 24,' }, { type: "text", text: '"sky": "clear"}' }] },
  { role: "assistant", content: "Paris: 18°C, cloudy. Tokyo: 24°C, clear." },
  { role: "user", content: "Thanks!" },
];

const qwen3 = [
  ...common,
  {
    name: "enable_thinking_false",
    request: { messages: [{ role: "user", content: "Quick answer: capital of Italy?" }], chat_template_kwargs: { enable_thinking: false } },
  },
  {
    name: "enable_thinking_true",
    request: { messages: [{ role: "user", content: "Think: capital of Italy?" }], chat_template_kwargs: { enable_thinking: true } },
  },
  {
    name: "enable_thinking_false_no_generation_prompt",
    request: {
      messages: [{ role: "user", content: "Hi" }, { role: "assistant", content: "Hello." }],
      chat_template_kwargs: { enable_thinking: false },
      add_generation_prompt: false,
    },
  },
  {
    name: "reasoning_content_history",
    request: {
      messages: [
        { role: "user", content: "What is 17*3?" },
        { role: "assistant", content: "51", reasoning_content: "17*3 = 51.\nSo the answer is 51." },
        { role: "user", content: "And 17*4?" },
        { role: "assistant", content: "\n68", reasoning_content: "\n17*4 = 68.\n" },
      ],
      add_generation_prompt: false,
    },
  },
  {
    name: "reasoning_before_last_query_is_dropped",
    request: {
      messages: [
        { role: "user", content: "First?" },
        { role: "assistant", content: "One.", reasoning_content: "dropped: before the last user query" },
        { role: "user", content: "Second?" },
      ],
    },
  },
  {
    name: "think_tags_inline_in_content",
    request: {
      messages: [
        { role: "user", content: "Q1" },
        { role: "assistant", content: "<think>\nreasoning inline\n</think>\n\nA1" },
        { role: "user", content: "Q2" },
        { role: "assistant", content: "<think>\nkept: after the last query\n</think>\n\nA2" },
      ],
      add_generation_prompt: false,
    },
  },
  {
    name: "tools_with_system",
    request: { messages: [multiTurn[0], { role: "user", content: "Weather in Paris?" }], tools: [weatherTool, searchTool] },
  },
  {
    name: "tools_without_system",
    request: { messages: [{ role: "user", content: "Search for kittens." }], tools: [searchTool] },
  },
  {
    name: "tool_calls_and_results",
    request: { messages: toolTurns, tools: [weatherTool] },
  },
  {
    name: "tool_calls_pending_results_thinking_off",
    request: {
      messages: toolTurns.slice(0, 5),
      tools: [weatherTool],
      chat_template_kwargs: { enable_thinking: false },
    },
  },
  {
    name: "tool_call_with_content_and_bad_arguments",
    request: {
      messages: [
        { role: "user", content: "Do it." },
        {
          role: "assistant",
          content: "Calling now.",
          tool_calls: [
            { id: "c1", type: "function", function: { name: "search", arguments: "not json" } },
            { id: "c2", type: "function", function: { name: "search", arguments: "" } },
            { id: "c3", type: "function", function: { name: "search", arguments: '{"q": "ünïcödé \\u00e9 \\ud83d\\ude00 </tool_call>", "limit": 10}' } },
          ],
        },
        { role: "tool", tool_call_id: "c1", content: "<tool_response>nested</tool_response>" },
      ],
      tools: [searchTool],
    },
  },
  {
    name: "user_tool_response_lookalike",
    request: {
      messages: [
        { role: "user", content: "Real question" },
        { role: "assistant", content: "A", reasoning_content: "r1" },
        { role: "user", content: "<tool_response>\nlooks like a tool result\n</tool_response>" },
        { role: "assistant", content: "B", reasoning_content: "r2" },
      ],
      add_generation_prompt: false,
    },
  },
  {
    name: "system_not_first",
    request: {
      messages: [
        { role: "user", content: "Hi" },
        { role: "system", content: "Late system message." },
        { role: "user", content: "Again" },
      ],
    },
  },
];

const llama = [
  ...common,
  {
    name: "tool_role_and_ignored_tools",
    request: { messages: toolTurns.filter((m) => m.content !== null), tools: [weatherTool] },
  },
  {
    name: "unknown_role",
    request: { messages: [{ role: "ipython", content: "output" }, { role: "user", content: "ok" }] },
  },
];

const models = { "llama-3.1": llama, qwen3 };

// The Rust tokenizer (the `tokenizers` Node binding of the library vLLM runs), when installed in
// .tmp/hf-rust as gen-tokenizer-goldens.mjs describes, is the second oracle for the prompt's ids.
let rust = null;
try {
  rust = createRequire(path.join(repo, ".tmp/hf-rust/package.json"))("tokenizers");
} catch {}
const versionOfRust = () =>
  JSON.parse(fs.readFileSync(path.join(repo, ".tmp/hf-rust/node_modules/tokenizers/package.json"), "utf8")).version;

// idsDigest is a long prompt's ids in brief: their count and the sha256 of their little-endian
// uint32 bytes.
const idsDigest = (ids) => {
  const buf = Buffer.alloc(4 * ids.length);
  ids.forEach((id, i) => buf.writeUInt32LE(id, 4 * i));
  return { count: ids.length, sha256: createHash("sha256").update(buf).digest("hex") };
};

for (const [model, cases] of Object.entries(models)) {
  const tok = await AutoTokenizer.from_pretrained(model);
  const rtok = rust ? rust.Tokenizer.fromFile(path.join(modelsDir, model, "tokenizer.json")) : null;
  const out = [];
  for (const c of cases) {
    const req = { ...(c.request || {}) };
    if (c.synthetic) req.messages = synthMessages(c.synthetic);
    const opts = {
      tokenize: false,
      add_generation_prompt: req.add_generation_prompt ?? true,
      ...(req.chat_template_kwargs || {}),
    };
    if (req.tools) opts.tools = req.tools.map(tool);
    const prompt = tok.apply_chat_template(conversation(req.messages), opts);
    const entry = { name: c.name };
    if (c.synthetic) {
      entry.synthetic = c.synthetic;
      const { messages: _, ...rest } = req;
      if (Object.keys(rest).length) entry.request = rest;
    } else {
      entry.request = c.request;
    }
    const bytes = Buffer.from(prompt, "utf8");
    // The prompt's token ids, as apply_chat_template(tokenize=true) makes them: the rendered text
    // encoded without adding special tokens (the template wrote them). rust_want_ids are the Rust
    // tokenizer's where they differ; the Go front door must match those.
    const ids = tok.encode(prompt, { add_special_tokens: false });
    const rids = rtok ? Array.from((await rtok.encode(prompt, null, { addSpecialTokens: false })).getIds()) : null;
    const differs = rids && (rids.length !== ids.length || rids.some((id, i) => id !== ids[i]));
    if (bytes.length > inlineLimit) {
      entry.want_sha256 = createHash("sha256").update(bytes).digest("hex");
      entry.want_len = bytes.length;
      entry.want_ids_digest = idsDigest(ids);
      if (differs) entry.rust_want_ids_digest = idsDigest(rids);
    } else {
      entry.want = prompt;
      entry.want_ids = ids;
      if (differs) entry.rust_want_ids = rids;
    }
    out.push(entry);
  }
  const file = path.join(outDir, `${model}.golden.json`);
  const doc = {
    comment: "Written by scripts/goldens/gen-chat-goldens.mjs; do not edit.",
    model,
    renderer: `@huggingface/transformers ${transformersVersion} (@huggingface/jinja ${jinjaVersion})`,
    tokenizer: rtok ? `@huggingface/transformers ${transformersVersion}; tokenizers ${versionOfRust()} (npm)` : `@huggingface/transformers ${transformersVersion}`,
    cases: out,
  };
  fs.mkdirSync(outDir, { recursive: true });
  fs.writeFileSync(file, JSON.stringify(doc, null, 1) + "\n");
  console.log(`${path.relative(repo, file)}: ${out.length} cases`);
}
