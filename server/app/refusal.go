package app

import (
	"fmt"
	"strconv"
	"time"
)

// Refusal is a message of the Publish protocol that a session refuses, described for any
// transport: what kind of refusal it is (which the gRPC edge maps to a status code), a stable reason
// clients branch on, the field and the setting it concerns. A bad field value is a
// *policy.FieldError instead, and an append's own failure the kvstate error it is; a Refusal is
// what the protocol itself refuses.
type Refusal struct {
	Kind RefusalKind
	// Reason is stable and upper-case (the gRPC edge's ErrorInfo reason), such as "HELLO_CHANGED".
	Reason string
	// Message says what was refused and what to do, for a person.
	Message string
	// Metadata names the field and the limit a limit refusal concerns, with its numbers (the gRPC
	// edge's ErrorInfo metadata); nil for the others.
	Metadata map[string]string
	// RetryAfter is when the same message may succeed; 0 when resending it cannot.
	RetryAfter time.Duration
}

// RefusalKind is the kind of a Refusal.
type RefusalKind uint8

// The kinds of refusal.
const (
	// RefusedPrecondition: the message is not valid in the stream's state (FAILED_PRECONDITION).
	RefusedPrecondition RefusalKind = iota + 1
	// RefusedLimit: the message is over a limit; RetryAfter says whether waiting helps
	// (RESOURCE_EXHAUSTED).
	RefusedLimit
	// RefusedUnavailable: the stream no longer holds its worker; the worker reconnects (UNAVAILABLE).
	RefusedUnavailable
	// RefusedInternal: the router failed (INTERNAL).
	RefusedInternal
)

func (r *Refusal) Error() string { return r.Message }

// precondition returns a RefusedPrecondition with reason.
func precondition(reason, format string, args ...any) error {
	return &Refusal{Kind: RefusedPrecondition, Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// unavailable returns a RefusedUnavailable: the stream ends and its worker registers again.
func unavailable(format string, args ...any) error {
	return &Refusal{Kind: RefusedUnavailable, Message: fmt.Sprintf(format, args...)}
}

// overLimit returns a RefusedLimit for a message whose field holds got, more than the setting limit
// allows (max): resending the same message cannot succeed.
func overLimit(reason, field, limit string, max, got int, format string, args ...any) error {
	return &Refusal{Kind: RefusedLimit, Reason: reason, Message: field + ": " + fmt.Sprintf(format, args...),
		Metadata: map[string]string{"field": field, "limit": limit, "max": strconv.Itoa(max), "got": strconv.Itoa(got)}}
}
