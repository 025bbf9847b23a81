package chattemplate

import (
	"fmt"
	"testing"
)

// benchConversations are the benchmark's conversations: about 1 KB, 16 KB and 220 KB of message
// text (the last is the picker's budget case: 40 turns of about 5.5 KB and a system prompt).
var benchConversations = []struct {
	name string
	spec synthSpec
}{
	{"1KB", synthSpec{Turns: 2, Lines: 9}},
	{"16KB", synthSpec{Turns: 8, Lines: 34, System: true}},
	{"220KB", synthSpec{Turns: 40, Lines: 88, System: true}},
}

// BenchmarkRender renders each conversation with each model's real template.
//
//	go test -run '^$' -bench BenchmarkRender -benchmem -count=3 ./server/frontdoor/chattemplate
//
// on the project's 2-core machine (AMD EPYC, Go 1.26.8), the middle of three runs:
//
//	llama-3.1/1KB      12 µs/op     12 KB/op    71 allocs/op
//	llama-3.1/16KB     57 µs/op    130 KB/op   216 allocs/op
//	llama-3.1/220KB   475 µs/op   1.7 MB/op    861 allocs/op
//	qwen3/1KB          21 µs/op     14 KB/op   109 allocs/op
//	qwen3/16KB         77 µs/op    131 KB/op   260 allocs/op
//	qwen3/220KB       595 µs/op   1.7 MB/op    953 allocs/op
//
// Time grows linearly with the conversation (16 KB to 220 KB: 14 times the text, 8 to 9 times
// the time). The profile of qwen3/220KB is memmove and the garbage collector: the library copies
// each message into `'<|im_start|>' + role + '\n' + content + ...` one + at a time, and its
// output builder grows by doubling, about 1.7 MB of copies for 220 KB; nothing is quadratic, and
// at well under the 5 ms budget it is left as is.
func BenchmarkRender(b *testing.B) {
	for _, model := range []string{"llama-3.1", "qwen3"} {
		tmpl := loadModel(b, model)
		for _, c := range benchConversations {
			msgs := synthMessages(c.spec)
			size := 0
			for _, m := range msgs {
				size += len(m.Content)
			}
			b.Run(fmt.Sprintf("%s/%s", model, c.name), func(b *testing.B) {
				b.SetBytes(int64(size))
				b.ReportAllocs()
				for b.Loop() {
					if _, err := tmpl.Render(msgs, Options{AddGenerationPrompt: true}); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
