import { BinaryReader, WireType } from "@bufbuild/protobuf/wire";
import { Code, ConnectError } from "@connectrpc/connect";

/** The ErrorInfo domain of every error the router returns. */
export const ERROR_DOMAIN = "kvrouter.v1";

const ERROR_INFO_TYPE = "google.rpc.ErrorInfo";
const RETRY_INFO_TYPE = "google.rpc.RetryInfo";

/** The google.rpc.ErrorInfo detail the router attaches to its errors. */
export interface ErrorInfo {
  /** The stable reason, for example "WORKER_SUPERSEDED" or "PUBLISH_BATCH_TOO_LARGE". */
  reason: string;
  /** The domain of the reason: ERROR_DOMAIN ("kvrouter.v1"). */
  domain: string;
  /** Details of the reason, for example the field and limit of PUBLISH_BATCH_TOO_LARGE. */
  metadata: Record<string, string>;
}

/**
 * Returns the router's google.rpc.ErrorInfo detail of an error (domain ERROR_DOMAIN; ErrorInfo of other
 * domains, say from a proxy, are skipped), or undefined when there is none or it cannot be decoded.
 *
 * The detail is decoded by hand from its three fields: neither @bufbuild/protobuf (whose well-known
 * types are google.protobuf only) nor connect ships the google.rpc.ErrorInfo schema.
 */
export function errorInfo(err: unknown): ErrorInfo | undefined {
  const ce = ConnectError.from(err);
  for (const d of ce.details) {
    if ("desc" in d || d.type !== ERROR_INFO_TYPE) {
      continue;
    }
    const info = decodeErrorInfo(d.value);
    if (info?.domain === ERROR_DOMAIN) {
      return info;
    }
  }
  return undefined;
}

/**
 * Returns the stable reason the router attached to an error (its google.rpc.ErrorInfo detail, for
 * example "WORKER_SUPERSEDED"), or undefined when there is none. Clients branch on the reason, never on
 * the message text.
 */
export function errorReason(err: unknown): string | undefined {
  return errorInfo(err)?.reason;
}

/**
 * Returns the delay, in milliseconds, that the router's google.rpc.RetryInfo detail suggests before a
 * retry, or undefined when there is none or it cannot be decoded. The router attaches one to
 * LOG_UNAVAILABLE (its shared state cannot answer yet) and to RESOURCE_EXHAUSTED. It is decoded by
 * hand, as ErrorInfo is.
 */
export function retryDelayMs(err: unknown): number | undefined {
  for (const d of ConnectError.from(err).details) {
    if ("desc" in d || d.type !== RETRY_INFO_TYPE) {
      continue;
    }
    return decodeRetryInfo(d.value);
  }
  return undefined;
}

/** Decodes RetryInfo { google.protobuf.Duration retry_delay = 1; } into milliseconds. */
function decodeRetryInfo(bytes: Uint8Array): number | undefined {
  try {
    const reader = new BinaryReader(bytes);
    let ms = 0;
    while (reader.pos < reader.len) {
      const [field, wireType] = reader.tag();
      if (field !== 1 || wireType !== WireType.LengthDelimited) {
        reader.skip(wireType);
        continue;
      }
      // Duration { int64 seconds = 1; int32 nanos = 2; }
      const duration = new BinaryReader(reader.bytes());
      let seconds = 0;
      let nanos = 0;
      while (duration.pos < duration.len) {
        const [f, wt] = duration.tag();
        if (f === 1 && wt === WireType.Varint) {
          seconds = Number(duration.int64());
        } else if (f === 2 && wt === WireType.Varint) {
          nanos = duration.int32();
        } else {
          duration.skip(wt);
        }
      }
      ms = Math.max(0, seconds * 1000 + nanos / 1e6);
    }
    return ms;
  } catch {
    return undefined; // malformed: as if absent
  }
}

/** Decodes ErrorInfo { string reason = 1; string domain = 2; map<string, string> metadata = 3; }. */
function decodeErrorInfo(bytes: Uint8Array): ErrorInfo | undefined {
  try {
    const info: ErrorInfo = { reason: "", domain: "", metadata: {} };
    const reader = new BinaryReader(bytes);
    while (reader.pos < reader.len) {
      const [field, wireType] = reader.tag();
      if (field === 1 && wireType === WireType.LengthDelimited) {
        info.reason = reader.string();
      } else if (field === 2 && wireType === WireType.LengthDelimited) {
        info.domain = reader.string();
      } else if (field === 3 && wireType === WireType.LengthDelimited) {
        const entry = new BinaryReader(reader.bytes());
        let key = "";
        let value = "";
        while (entry.pos < entry.len) {
          const [f, wt] = entry.tag();
          if (f === 1 && wt === WireType.LengthDelimited) {
            key = entry.string();
          } else if (f === 2 && wt === WireType.LengthDelimited) {
            value = entry.string();
          } else {
            entry.skip(wt);
          }
        }
        info.metadata[key] = value;
      } else {
        reader.skip(wireType);
      }
    }
    return info;
  } catch {
    return undefined; // malformed: as if absent
  }
}

/**
 * Builds the INVALID_ARGUMENT error the router would answer for a field that breaks a rule, with the
 * router's own message ("field: rule"), so that a request it would refuse fails before it is sent.
 */
export function invalidArgument(field: string, rule: string): ConnectError {
  return new ConnectError(`${field}: ${rule}`, Code.InvalidArgument);
}

/**
 * WorkerSupersededError ends a Publisher when a newer Publish stream registered the same worker_id and
 * dp_rank (FAILED_PRECONDITION, reason WORKER_SUPERSEDED). It is never retried: it means another
 * process registered the same worker.
 */
export class WorkerSupersededError extends Error {
  /** The router's status, with its message and details. */
  override readonly cause: ConnectError;

  constructor(cause: ConnectError) {
    super(`kvrouter: worker superseded: a newer Publish stream registered this worker_id and dp_rank (two processes with the same worker_id?); the publisher stopped and will not reconnect: ${cause.rawMessage}`);
    this.name = "WorkerSupersededError";
    this.cause = cause;
  }
}

/**
 * PublisherFullError rejects a publish when the window of unacknowledged events is full and the
 * publisher was configured to reject rather than wait (PublisherOptions.whenFull = "reject").
 */
export class PublisherFullError extends Error {
  constructor(unacked: number, max: number, adding: number) {
    super(`kvrouter: publisher full: ${unacked} events await the router's ack, and ${adding} more would exceed maxUnacked ${max}; retry after acks arrive or raise maxUnacked`);
    this.name = "PublisherFullError";
  }
}

/** PublisherClosedError rejects a publish or load report made after close() was called. */
export class PublisherClosedError extends Error {
  constructor() {
    super("kvrouter: the publisher is closed");
    this.name = "PublisherClosedError";
  }
}
