package chattemplate

import "github.com/kvrouter/kvrouter/server/frontdoor/testmodels"

// synthSpec is a golden case's recipe for a large conversation.
type synthSpec = testmodels.Synth

// synthMessages builds the recipe's conversation (testmodels.Synth.Conversation) as messages.
func synthMessages(s synthSpec) []Message {
	turns := s.Conversation()
	msgs := make([]Message, len(turns))
	for i, t := range turns {
		msgs[i] = Message{Role: t.Role, Content: t.Content}
	}
	return msgs
}
