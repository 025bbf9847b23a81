package policy

import "errors"

// Routing errors. The server maps each to one gRPC status code in one place.
var (
	// ErrUnknownModel: no worker serves the requested model.
	ErrUnknownModel = errors.New("no worker serves this model")
	// ErrNoWorkers: the model has no worker of the role a hop needs.
	ErrNoWorkers = errors.New("no worker of the needed role")
	// ErrNoEligibleWorkers: the request's allow-list excludes every worker of a hop.
	ErrNoEligibleWorkers = errors.New("no eligible worker")
	// ErrPinnedWorkerNotFound: a pinned worker (or rank) is not among the hop's workers.
	ErrPinnedWorkerNotFound = errors.New("pinned worker not found")
	// ErrPinnedWorkerOverloaded: the pinned worker is over the queue threshold.
	ErrPinnedWorkerOverloaded = errors.New("pinned worker is overloaded")
	// ErrAllWorkersOverloaded: every eligible worker is over the queue threshold
	// (Dynamo's AllEligibleWorkersOverloaded).
	ErrAllWorkersOverloaded = errors.New("all eligible workers are overloaded")
	// ErrDisaggRequired: enforce_disagg is set and the model has no prefill worker.
	ErrDisaggRequired = errors.New("enforce_disagg is set and the model has no prefill worker")
)
