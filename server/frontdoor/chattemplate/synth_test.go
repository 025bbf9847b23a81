package chattemplate

import (
	"fmt"
	"strings"
)

// synthWords and synthText are the filler of the synthetic golden cases, built exactly as
// scripts/goldens/gen-chat-goldens.mjs builds them.
var synthWords = []string{
	"alpha", "héllo", "wörld", "世界", "你好", "🙂", "👩\u200d👩\u200d👧", "e\u0301", "naïve", "Ω",
	"{{ x }}", "{% if y %}", "quote\"d", "back\\slash", "tab\there", "<b>&amp;</b>",
}

func synthText(seed, lines int) string {
	var b strings.Builder
	for i := range lines {
		a := synthWords[(i*7+seed)%len(synthWords)]
		c := synthWords[(i*3+seed*5)%len(synthWords)]
		fmt.Fprintf(&b, "%d.%d %s lorem ipsum dolor sit amet %s consectetur\n", seed, i, a, c)
	}
	return b.String()
}

// synthSpec is a golden case's recipe for a large conversation.
type synthSpec struct {
	Turns  int  `json:"turns"`
	Lines  int  `json:"lines"`
	System bool `json:"system"`
}

// synthMessages builds the synthetic conversation: an optional system message, then Turns
// messages alternating user and assistant, each of Lines lines.
func synthMessages(s synthSpec) []Message {
	var msgs []Message
	if s.System {
		msgs = append(msgs, Message{Role: "system", Content: synthText(0, s.Lines)})
	}
	for t := range s.Turns {
		role := "user"
		if t%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, Message{Role: role, Content: synthText(t+1, s.Lines)})
	}
	return msgs
}
