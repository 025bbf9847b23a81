import type { Interceptor, Transport } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";

/**
 * A gRPC (HTTP/2) transport together with the HTTP/2 session it owns, so that the client that made it
 * can close the connection when it is done.
 */
export interface OwnedTransport {
  /** The transport to create clients with. */
  readonly transport: Transport;
  /** Closes the HTTP/2 connection; calls in flight fail. */
  close(): void;
}

/** Options of openTransport. */
export interface TransportOptions {
  /**
   * Connect interceptors applied to every call of the transport; the first one is the outermost (it
   * sees each call first). They can add headers (authentication), log, or observe and change the
   * messages of streaming calls (req.stream is true and req.message is an AsyncIterable).
   */
  interceptors?: Interceptor[];
}

/**
 * Turns an address such as "127.0.0.1:50051", "localhost:50051" or "http://host:port" into the base URL
 * the transport dials. Addresses without a scheme are plaintext (h2c), as the router serves by default;
 * "https://host:port" dials TLS.
 */
export function baseUrl(address: string): string {
  return /^https?:\/\//.test(address) ? address : `http://${address}`;
}

/**
 * Opens a gRPC transport over HTTP/2 to one router address, with keepalive pings so that a dead
 * connection is noticed, and the given interceptors.
 */
export function openTransport(address: string, opts: TransportOptions = {}): OwnedTransport {
  const url = baseUrl(address);
  const sessionManager = new Http2SessionManager(url, { pingIntervalMs: 15_000, pingTimeoutMs: 10_000, idleConnectionTimeoutMs: 60_000 });
  const transport = createGrpcTransport({ baseUrl: url, sessionManager, interceptors: [...(opts.interceptors ?? [])] });
  return {
    transport,
    close: () => sessionManager.abort(),
  };
}
