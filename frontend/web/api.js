// Talking to this server: the API key, errors, and the SSE stream reader.

import { apiKey, setApiKey } from "./store.js";

/** An HTTP error from the API, with the server's own message. */
export class ApiError extends Error {
  constructor(status, message, retryAfterS = null) {
    super(message);
    this.status = status;
    this.retryAfterS = retryAfterS;
  }
}

let keyWaiters = [];

/**
 * Wait until the user enters an API key (the page shows the key form).
 * Resolves with the key; rejects with an AbortError if `signal` fires first.
 */
export function requestKey(signal) {
  document.getElementById("key-form").hidden = false;
  document.getElementById("key-input").focus();
  return new Promise((resolve, reject) => {
    const waiter = { resolve, reject };
    keyWaiters.push(waiter);
    signal?.addEventListener("abort", () => {
      keyWaiters = keyWaiters.filter((w) => w !== waiter);
      reject(new DOMException("stopped", "AbortError"));
    }, { once: true });
  });
}

/** Called by the key form: store the key and wake whoever waits for it. */
export function provideKey(key) {
  setApiKey(key);
  document.getElementById("key-form").hidden = true;
  const waiters = keyWaiters;
  keyWaiters = [];
  for (const w of waiters) w.resolve(key);
}

/** fetch() with the stored key as a Bearer header. */
export function apiFetch(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = apiKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  return fetch(path, { ...options, headers, cache: "no-store" });
}

/** The error a non-2xx response carries, read from its JSON body. */
export async function errorOf(response) {
  let message = `HTTP ${response.status}`;
  try {
    const body = await response.json();
    if (body?.error?.message) message = body.error.message;
  } catch {
    // not JSON (a proxy's page): the status says enough
  }
  const retry = Number.parseFloat(response.headers.get("Retry-After"));
  return new ApiError(response.status, message, Number.isFinite(retry) ? retry : null);
}

/**
 * The `data:` payloads of a server-sent event stream, parsed: objects, or the
 * string "[DONE]". Ends when the body ends; throws AbortError when aborted.
 * Comment lines (`: waiting, position 3` while the job waits in the pool's
 * queue) go to `onComment`, without the colon.
 */
export async function* sseEvents(response, onComment = () => {}) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith(":")) onComment(line.slice(1).trim());
        }
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (!data) continue;
        yield data === "[DONE]" ? data : JSON.parse(data);
      }
    }
  } finally {
    reader.releaseLock();
  }
}
