package server

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
)

// errorDomain is the ErrorInfo domain of every error the router returns.
const errorDomain = "kvrouter.v1"

// domainErrors maps each domain error to its status code and a stable reason that clients can branch
// on (never on message text). It is the one place where domain errors become wire errors.
var domainErrors = []struct {
	err    error
	code   codes.Code
	reason string
}{
	{policy.ErrUnknownModel, codes.NotFound, "UNKNOWN_MODEL"},
	{policy.ErrNoWorkers, codes.Unavailable, "NO_WORKERS"},
	{policy.ErrNoEligibleWorkers, codes.FailedPrecondition, "NO_ELIGIBLE_WORKERS"},
	{policy.ErrPinnedWorkerNotFound, codes.NotFound, "PINNED_WORKER_NOT_FOUND"},
	{policy.ErrPinnedWorkerOverloaded, codes.ResourceExhausted, "PINNED_WORKER_OVERLOADED"},
	{app.ErrQueueFull, codes.ResourceExhausted, "QUEUE_FULL"},
	{app.ErrBookingsFull, codes.ResourceExhausted, "BOOKINGS_FULL"},
	{app.ErrCredentialBookingsFull, codes.ResourceExhausted, "CREDENTIAL_BOOKINGS_FULL"},
	{policy.ErrAllWorkersOverloaded, codes.ResourceExhausted, "ALL_WORKERS_OVERLOADED"},
	{policy.ErrDisaggRequired, codes.FailedPrecondition, "DISAGG_REQUIRED"},
	{kvstate.ErrAlreadyBooked, codes.AlreadyExists, "ALREADY_BOOKED"},
	{kvstate.ErrUnknownRequest, codes.NotFound, "UNKNOWN_REQUEST"},
	{kvstate.ErrUnknownWorker, codes.Unavailable, "UNKNOWN_WORKER"},
	{kvstate.ErrWorkerConflict, codes.FailedPrecondition, "WORKER_CONFLICT"},
	{kvstate.ErrBlockSizeMismatch, codes.FailedPrecondition, "BLOCK_SIZE_MISMATCH"},
	{kvstate.ErrStaleDump, codes.FailedPrecondition, "STALE_DUMP"},
	{kvstate.ErrSuperseded, codes.FailedPrecondition, "WORKER_SUPERSEDED"},
	{kvstate.ErrLogUnavailable, codes.Unavailable, "LOG_UNAVAILABLE"},
	{kvstate.ErrModelNotServed, codes.FailedPrecondition, "MODEL_NOT_SERVED"},
}

// retryDelay is suggested to clients on RESOURCE_EXHAUSTED: long enough for some prefill to finish.
const retryDelay = 100 * time.Millisecond

// unavailableRetryDelay is suggested to clients on UNAVAILABLE from the shared log (LOG_UNAVAILABLE):
// what it waits for (Redis answering again, another replica publishing, a lost log reseeded) takes
// a fraction of a second at best.
const unavailableRetryDelay = 250 * time.Millisecond

// toStatus converts a domain error to a gRPC status error. Errors that already carry a status pass
// through, context errors become CANCELED or DEADLINE_EXCEEDED, and anything unknown is INTERNAL.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return status.FromContextError(err).Err()
	}
	var fe *policy.FieldError
	if errors.As(err, &fe) {
		return invalidArgument(fe.Field, fe.Rule)
	}
	var r *app.Refusal
	if errors.As(err, &r) {
		return refusalStatus(r)
	}
	for _, d := range domainErrors {
		if errors.Is(err, d.err) {
			st := status.New(d.code, err.Error())
			details := []protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: d.reason, Domain: errorDomain}}
			switch {
			case d.code == codes.ResourceExhausted:
				details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(retryDelay)})
			case d.err == kvstate.ErrLogUnavailable:
				details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(unavailableRetryDelay)})
			}
			return withDetails(st, details...)
		}
	}
	return status.Error(codes.Internal, err.Error())
}

// refusalCodes maps the kinds of a Publish session's refusal to status codes.
var refusalCodes = map[app.RefusalKind]codes.Code{
	app.RefusedPrecondition: codes.FailedPrecondition,
	app.RefusedLimit:        codes.ResourceExhausted,
	app.RefusedUnavailable:  codes.Unavailable,
	app.RefusedInternal:     codes.Internal,
}

// refusalStatus converts a Publish session's refusal: its reason and metadata become an
// ErrorInfo, its RetryAfter a RetryInfo.
func refusalStatus(r *app.Refusal) error {
	code, ok := refusalCodes[r.Kind]
	if !ok {
		code = codes.Internal
	}
	st := status.New(code, r.Message)
	var details []protoadapt.MessageV1
	if r.Reason != "" {
		details = append(details, &errdetails.ErrorInfo{Reason: r.Reason, Domain: errorDomain, Metadata: r.Metadata})
	}
	if r.RetryAfter > 0 {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(r.RetryAfter)})
	}
	if len(details) == 0 {
		return st.Err()
	}
	return withDetails(st, details...)
}

// invalidArgument returns INVALID_ARGUMENT naming the field and the rule it broke, with a BadRequest
// detail so clients can show the field without parsing the message.
func invalidArgument(field, rule string) error {
	st := status.New(codes.InvalidArgument, field+": "+rule)
	return withDetails(st, &errdetails.BadRequest{
		FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: field, Description: rule}},
	})
}

// invalidArgumentf is invalidArgument with a formatted rule.
func invalidArgumentf(field, format string, args ...any) error {
	return invalidArgument(field, fmt.Sprintf(format, args...))
}

// failedPrecondition returns FAILED_PRECONDITION with a stable reason.
func failedPrecondition(reason, format string, args ...any) error {
	return withDetails(status.Newf(codes.FailedPrecondition, format, args...),
		&errdetails.ErrorInfo{Reason: reason, Domain: errorDomain})
}

func withDetails(st *status.Status, details ...protoadapt.MessageV1) error {
	if withd, err := st.WithDetails(details...); err == nil {
		return withd.Err()
	}
	return st.Err()
}
