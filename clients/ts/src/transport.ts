import * as http2 from "node:http2";
import { connect as netConnect, isIP, type Socket } from "node:net";
import { connect as tlsConnect } from "node:tls";
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

/** The keepalive of every connection: a ping every 15 s of silence, dead after 10 s without an answer. */
const PING = { pingIntervalMs: 15_000, pingTimeoutMs: 10_000, idleConnectionTimeoutMs: 60_000 } as const;

/**
 * Opens a gRPC transport over HTTP/2 to one router address, with keepalive pings so that a dead
 * connection is noticed, and the given interceptors. As @connectrpc/connect-node does, the connection
 * keeps the Node.js process alive while a call is open on it, and not while it is idle.
 */
export function openTransport(address: string, opts: TransportOptions = {}): OwnedTransport {
  const url = baseUrl(address);
  return own(url, new Http2SessionManager(url, PING), opts);
}

/**
 * Opens a transport as openTransport does, except that its connections never keep the Node.js process
 * alive, not even while a call is open or a connection is being made: the Publisher's stream stays
 * open for good, so the Publisher itself keeps the process alive while it has work to do (and only
 * then). Not exported from the package.
 * @internal
 */
export function openDetachedTransport(address: string, opts: TransportOptions = {}): OwnedTransport {
  const url = baseUrl(address);
  return own(url, new DetachedSessionManager(url, PING, { createConnection: unrefConnection }), opts);
}

function own(url: string, sessionManager: Http2SessionManager, opts: TransportOptions): OwnedTransport {
  const transport = createGrpcTransport({ baseUrl: url, sessionManager, interceptors: [...(opts.interceptors ?? [])] });
  return {
    transport,
    close: () => sessionManager.abort(),
  };
}

/**
 * An Http2SessionManager whose sessions do not hold the process: the manager ref()s a session while
 * it has a stream open (and while it verifies an idle one with a ping), and this unref()s it again as
 * soon as the stream is made. ClientHttp2Session.unref() is the session's socket's unref(): a flag,
 * not a count, so one call undoes any number of the manager's.
 */
class DetachedSessionManager extends Http2SessionManager {
  override async request(
    method: string,
    path: string,
    headers: http2.OutgoingHttpHeaders,
    options: Omit<http2.ClientSessionRequestOptions, "signal">,
  ): Promise<http2.ClientHttp2Stream> {
    const stream = await super.request(method, path, headers, options);
    stream.session?.unref();
    return stream;
  }
}

/**
 * Dials what http2.connect dials by default (plaintext TCP for http:, TLS with ALPN "h2" and the host
 * as SNI name for https:), with the socket unref()ed from the start, so that a connection attempt that
 * hangs (a dropped SYN, a TLS handshake nobody answers) does not hold the process either.
 */
function unrefConnection(authority: URL, options: http2.SessionOptions): Socket {
  const host = authority.hostname.startsWith("[") ? authority.hostname.slice(1, -1) : authority.hostname || "localhost";
  const tls = authority.protocol === "https:";
  const port = Number(authority.port || (tls ? 443 : 80));
  const o = options as http2.SecureClientSessionOptions;
  const socket = tls
    ? tlsConnect({ ...o, host, port, ALPNProtocols: ["h2"], ...(o.servername || isIP(host) ? {} : { servername: host }) })
    : netConnect({ port, host, ...(options as object) });
  return socket.unref();
}
