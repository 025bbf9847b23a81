package enginefeed

import (
	"encoding/binary"
	"fmt"
	"math"
)

// Message is one message of the engine's PUB socket.
type Message struct {
	Topic   []byte
	Seq     uint64 // the batch's sequence number: 0 for the first batch of an engine process, then +1
	Payload []byte // the msgpack batch
}

// ParseMessage reads the frames of one PUB message: topic, 8-byte big-endian sequence number, payload.
func ParseMessage(frames [][]byte) (Message, error) {
	if len(frames) != 3 {
		return Message{}, errorf(Malformed, "a message of %d frames, want 3 (topic, seq, payload)", len(frames))
	}
	if len(frames[1]) != 8 {
		return Message{}, errorf(Malformed, "a sequence frame of %d bytes, want 8", len(frames[1]))
	}
	return Message{Topic: frames[0], Seq: binary.BigEndian.Uint64(frames[1]), Payload: frames[2]}, nil
}

// MessageFrames returns the frames of a PUB message, as engines send them.
func MessageFrames(m Message) [][]byte {
	return [][]byte{m.Topic, SeqBytes(m.Seq), m.Payload}
}

// SeqBytes returns a sequence number as engines write it: 8 bytes, big-endian.
func SeqBytes(seq uint64) []byte {
	return binary.BigEndian.AppendUint64(make([]byte, 0, 8), seq)
}

// ReplayEnd is the sequence number of the replay endpoint's last reply: -1 as 8 bytes.
const ReplayEnd = math.MaxUint64

// ReplayRequest returns the frames a DEALER sends to the engine's ROUTER replay endpoint to get every
// buffered batch from seq on: an empty delimiter and the sequence number.
func ReplayRequest(seq uint64) [][]byte {
	return [][]byte{{}, SeqBytes(seq)}
}

// ParseReplay reads one reply of the replay endpoint, in either of its forms: [seq, payload] (vLLM
// before June 2026, SGLang) or [topic, seq, payload] (vLLM since), after the empty delimiter when
// the socket left it. end is true for the last reply (sequence -1, empty payload), which carries no
// batch.
func ParseReplay(frames [][]byte) (m Message, end bool, err error) {
	if len(frames) > 0 && len(frames[0]) == 0 && len(frames) >= 3 {
		frames = frames[1:] // the delimiter
	}
	switch len(frames) {
	case 2:
		m.Payload = frames[1]
		frames = frames[:1]
	case 3:
		m.Topic, m.Payload = frames[0], frames[2]
		frames = frames[1:2]
	default:
		return Message{}, false, errorf(Malformed, "a replay reply of %d frames, want [topic,] seq, payload", len(frames))
	}
	if len(frames[0]) != 8 {
		return Message{}, false, errorf(Malformed, "a replay sequence frame of %d bytes, want 8", len(frames[0]))
	}
	m.Seq = binary.BigEndian.Uint64(frames[0])
	if m.Seq == ReplayEnd || len(m.Payload) == 0 {
		return m, true, nil
	}
	return m, false, nil
}

// String describes a message for a log line.
func (m Message) String() string {
	return fmt.Sprintf("seq %d, topic %q, %d bytes", m.Seq, m.Topic, len(m.Payload))
}
