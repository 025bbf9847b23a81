# kvrouter's container image: a static binary on distroless (no shell, no package manager), run as
# a non-root user. The entry point is the binary: `serve` by default, `bridge` for the engine bridge.
#
#   docker build -t kvrouter:v0.1.0 --build-arg KVROUTER_COMMIT=$(git rev-parse HEAD) .
#   docker run --rm -p 50051:50051 -v "$PWD/tls:/tls:ro" kvrouter:v0.1.0 serve --listen :50051 \
#     --tls-cert-file /tls/tls.crt --tls-key-file /tls/tls.key
#
# A listen address other than loopback refuses to start without TLS unless --plaintext asks for it
# (docs/security.md). Kubernetes manifests: deploy/kubernetes. deploy/deploy_test.go lints this file.
#
# Pinned by version; pin by digest too (golang:1.26.8@sha256:...) where builds must be reproducible.
# The builder's Go is go.mod's go version (the test checks it).
FROM golang:1.26.8 AS build
WORKDIR /src
# The client, the contract's code and the block hashing are modules of their own that go.mod
# replaces with these directories: their go.mod files come first too.
COPY go.mod go.sum ./
COPY clients/go/go.mod clients/go/go.sum ./clients/go/
COPY gen/go.mod gen/go.sum ./gen/
COPY kvstate/blockhash/go.mod kvstate/blockhash/go.sum ./kvstate/blockhash/
RUN go mod download
COPY . .
# Static (no cgo, so no libc needed at run time) and reproducible (no build paths in the binary).
ENV CGO_ENABLED=0
# `kvrouter --version` names the commit given here: docker build --build-arg KVROUTER_COMMIT=$(git rev-parse HEAD) .
ARG KVROUTER_COMMIT=""
RUN go build -trimpath -ldflags="-s -w -X main.commit=${KVROUTER_COMMIT}" -o /out/kvrouter ./cmd/kvrouter
# A probe for Docker's HEALTHCHECK (the image has no shell to run anything else). Kubernetes does
# not need it: its native gRPC probes call the health service themselves (deploy/kubernetes).
RUN GOBIN=/out go install -trimpath -ldflags="-s -w" github.com/grpc-ecosystem/grpc-health-probe@v0.4.63

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/kvrouter /kvrouter
COPY --from=build /out/grpc-health-probe /grpc-health-probe
# distroless's "nonroot" user, by number, so that runAsNonRoot can verify it.
USER 65532:65532
# gRPC, the health-only port (--health-listen), /metrics (--metrics-listen).
EXPOSE 50051 8086 9090
# The health service alone, in plaintext, on loopback inside the container: what the HEALTHCHECK
# below probes, whatever TLS and credentials the main port requires. It is an environment variable,
# so it wins over health_listen in a --config file; a --health-listen flag wins over it (the
# Kubernetes manifests pass --health-listen=:8086 so that the kubelet can reach it).
ENV KVROUTER_HEALTH_LISTEN=127.0.0.1:8086
# The routing service's health: NOT_SERVING while a replica catches up with the shared log and
# while it drains at shutdown.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["/grpc-health-probe", "-addr=127.0.0.1:8086", "-service=kvrouter.v1.RouterService"]
ENTRYPOINT ["/kvrouter"]
CMD ["serve"]
