// The conversation view: send, stream the answer in, stop, retry when busy.

import { ApiError, apiFetch, errorOf, requestKey, sseEvents } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import {
  loadConversations, loadSettings, newConversation, saveConversations, saveSettings,
} from "./store.js";

const $ = (id) => document.getElementById(id);

//: Never wait less than this between two tries when the pool is full.
const MIN_RETRY_S = 1;

const SETTING_INPUTS = {
  temperature: ["set-temperature", Number],
  top_p: ["set-top-p", Number],
  max_tokens: ["set-max-tokens", (v) => Number.parseInt(v, 10)],
  ignore_eos: ["set-ignore-eos", Boolean],
  system: ["set-system", String],
};

export class ChatView {
  constructor() {
    this.conversations = loadConversations();
    this.current = this.conversations[0] || this.createConversation();
    this.settings = loadSettings();
    this.controller = null; // AbortController of the request in flight
    this.bindSettings();
    this.bindComposer();
    this.loadModels();
    $("new-chat").addEventListener("click", () => {
      if (this.controller) return;
      this.current = this.createConversation();
      this.renderAll();
      $("prompt").focus();
    });
    this.renderAll();
  }

  createConversation() {
    const c = newConversation();
    this.conversations.unshift(c);
    return c;
  }

  bindSettings() {
    for (const [name, [id, parse]] of Object.entries(SETTING_INPUTS)) {
      const input = $(id);
      const prop = input.type === "checkbox" ? "checked" : "value";
      input[prop] = this.settings[name];
      input.addEventListener("change", () => {
        const value = parse(input[prop]);
        if (typeof value === "number" && !Number.isFinite(value)) return;
        this.settings[name] = value;
        saveSettings(this.settings);
      });
    }
  }

  /** The picker lists the pool's models (``/v1/models``, no key needed);
   * it shows only when there is more than one to choose from. */
  async loadModels() {
    let models = [];
    try {
      const response = await apiFetch("/v1/models");
      if (response.ok) models = (await response.json()).data || [];
    } catch {
      return; // no pool yet: the default model, as before
    }
    const select = $("set-model");
    select.replaceChildren(...models.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      const aliases = (m.aliases || []).join(", ");
      option.textContent = aliases ? `${m.id} (${aliases})` : m.id;
      return option;
    }));
    const ids = models.map((m) => m.id);
    if (!ids.includes(this.settings.model)) this.settings.model = ids[0] || "";
    select.value = this.settings.model;
    $("model-picker").hidden = models.length < 2;
    select.addEventListener("change", () => {
      this.settings.model = select.value;
      saveSettings(this.settings);
    });
  }

  bindComposer() {
    const prompt = $("prompt");
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    prompt.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape") this.stop();
    });
  }

  stop() {
    this.controller?.abort();
  }

  setStatus(text, kind = "") {
    const status = $("status");
    status.textContent = text;
    status.dataset.kind = kind;
  }

  requestBody() {
    const s = this.settings;
    const messages = [];
    if (s.system.trim()) messages.push({ role: "system", content: s.system });
    for (const m of this.current.messages) {
      if (m.role !== "error") messages.push({ role: m.role, content: m.content });
    }
    const body = {
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: s.temperature,
      top_p: s.top_p,
      max_tokens: s.max_tokens,
    };
    if (s.ignore_eos) body.ignore_eos = true;
    if (s.model) body.model = s.model;
    return body;
  }

  async send() {
    const prompt = $("prompt");
    const text = prompt.value.trim();
    if (!text || this.controller) return;
    prompt.value = "";
    const conv = this.current;
    conv.messages.push({ role: "user", content: text });
    if (conv.title === "New chat") conv.title = text.slice(0, 60);
    conv.updated = Date.now();
    this.persist();
    this.renderAll();

    const controller = new AbortController();
    this.controller = controller;
    $("stop").disabled = false;
    $("send").disabled = true;
    const answer = { role: "assistant", content: "" };
    const el = this.appendMessage(answer, true);
    try {
      await this.exchange(answer, el, controller.signal);
    } catch (err) {
      if (err.name === "AbortError") {
        this.setStatus(answer.content ? "Stopped." : "Stopped before an answer.");
        if (answer.content) answer.stopped = true;
      } else {
        this.setStatus(err.message, "error");
      }
    } finally {
      this.controller = null;
      $("stop").disabled = true;
      $("send").disabled = false;
      el.classList.remove("streaming");
      if (answer.content) {
        conv.messages.push(answer);
        conv.updated = Date.now();
        this.persist();
      } else {
        el.remove();
      }
      this.renderList();
    }
  }

  /** One request, tried again while the pool is full or a key is needed. */
  async exchange(answer, el, signal) {
    for (let attempt = 1; ; attempt++) {
      this.setStatus("Waiting for a slot…");
      const response = await apiFetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(this.requestBody()),
        signal,
      });
      if (response.status === 401) {
        this.setStatus("This server needs an API key.", "busy");
        await requestKey(signal);
        continue;
      }
      if (response.status === 503) {
        const err = await errorOf(response);
        await this.countdown(err, attempt, signal);
        continue;
      }
      if (!response.ok) throw await errorOf(response);
      this.setStatus("Generating…");
      try {
        await this.readStream(response, answer, el);
      } catch (err) {
        // A wait in the pool's queue that passed its deadline: as a 503.
        if (!(err instanceof ApiError && err.status === 503)) throw err;
        await this.countdown(err, attempt, signal);
        continue;
      }
      return;
    }
  }

  async countdown(err, attempt, signal) {
    const wait = Math.max(MIN_RETRY_S, Math.ceil(err.retryAfterS ?? MIN_RETRY_S));
    for (let left = wait; left > 0; left--) {
      this.setStatus(
        `All slots are busy (${err.message}). Retrying in ${left} s` +
          (attempt > 1 ? ` (try ${attempt + 1}).` : "."),
        "busy",
      );
      await new Promise((resolve, reject) => {
        const timer = setTimeout(resolve, 1000);
        signal.addEventListener("abort", () => {
          clearTimeout(timer);
          reject(new DOMException("stopped", "AbortError"));
        }, { once: true });
      });
    }
  }

  async readStream(response, answer, el) {
    let scheduled = false;
    const paint = () => {
      scheduled = false;
      this.renderBody(el, answer.content);
    };
    let finish = null;
    let waiting = false;
    // The pool's queue (--queue-max) says where the job stands while it
    // waits for a slot: ": waiting, position N" (1: next).
    const onComment = (comment) => {
      const place = /^waiting, position (\d+)/.exec(comment);
      if (!place) return;
      waiting = true;
      this.setStatus(`Waiting for a slot: position ${place[1]} in the queue…`, "busy");
    };
    for await (const event of sseEvents(response, onComment)) {
      if (event === "[DONE]") break;
      if (event.error?.code === "no_slot" && waiting) {
        // The status came at once, while the job waited; its wait ended
        // without a slot: "no slot available; retry after N s".
        const retry = /retry after (\d+) s/.exec(event.error.message);
        throw new ApiError(503, event.error.message, retry ? Number(retry[1]) : null);
      }
      if (event.error) throw new Error(`The answer failed: ${event.error.message}`);
      if (waiting) {
        waiting = false;
        this.setStatus("Generating…");
      }
      const choice = event.choices?.[0];
      const delta = choice?.delta?.content;
      if (delta) {
        answer.content += delta;
        if (!scheduled) {
          scheduled = true;
          requestAnimationFrame(paint);
        }
      }
      if (choice?.finish_reason) finish = choice.finish_reason;
      if (event.usage) answer.usage = event.usage;
    }
    paint();
    if (finish === null) throw new Error("The stream ended without a finish.");
    const usage = answer.usage ? ` · ${answer.usage.completion_tokens} tokens` : "";
    this.setStatus(`Done (${finish})${usage}.`);
  }

  persist() {
    saveConversations(this.conversations);
  }

  renderBody(el, content) {
    const body = el.querySelector(".body");
    body.replaceChildren(renderMarkdown(content));
  }

  appendMessage(message, streaming = false) {
    const li = document.createElement("li");
    li.className = `message ${message.role}${streaming ? " streaming" : ""}`;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = message.role === "user" ? "You" : "Model";
    const body = document.createElement("div");
    body.className = "body";
    li.append(who, body);
    this.renderBody(li, message.content);
    if (message.stopped) {
      const note = document.createElement("span");
      note.className = "note";
      note.textContent = "(stopped)";
      li.append(note);
    }
    $("messages").append(li);
    li.scrollIntoView({ block: "end" });
    return li;
  }

  renderAll() {
    $("messages").replaceChildren();
    for (const m of this.current.messages) this.appendMessage(m);
    this.renderList();
  }

  renderList() {
    const list = $("conversations");
    list.replaceChildren();
    for (const c of this.conversations) {
      if (!c.messages.length && c !== this.current) continue;
      const li = document.createElement("li");
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = c.title;
      if (c === this.current) button.setAttribute("aria-current", "true");
      button.addEventListener("click", () => {
        if (this.controller) return;
        this.current = c;
        this.setStatus("");
        this.renderAll();
      });
      li.append(button);
      list.append(li);
    }
  }
}
