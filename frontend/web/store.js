// What the page keeps in this browser (localStorage): conversations, the
// sampling settings and the API key. Nothing of it is sent anywhere except
// the key, as a Bearer header to this same server.

const CONVERSATIONS = "llamapool.conversations";
const SETTINGS = "llamapool.settings";
const API_KEY = "llamapool.apiKey";

//: Most conversations kept; the oldest beyond this are dropped.
const MAX_CONVERSATIONS = 100;

export const DEFAULT_SETTINGS = Object.freeze({
  temperature: 0.8,
  top_p: 0.95,
  max_tokens: 512,
  ignore_eos: false,
  system: "",
  model: "", // "": the pool's default model
});

function read(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback; // unreadable (another version's data): start over
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch {
    // Quota exceeded or storage disabled: the page still works, unsaved.
  }
}

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
}

export function saveSettings(settings) {
  write(SETTINGS, settings);
}

export function apiKey() {
  return localStorage.getItem(API_KEY) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(API_KEY, key);
  else localStorage.removeItem(API_KEY);
}

/** Conversations, newest first: {id, title, updated, messages: [{role, content}]}. */
export function loadConversations() {
  const list = read(CONVERSATIONS, []);
  return Array.isArray(list) ? list.filter((c) => c && Array.isArray(c.messages)) : [];
}

export function saveConversations(list) {
  list.sort((a, b) => b.updated - a.updated);
  write(CONVERSATIONS, list.slice(0, MAX_CONVERSATIONS));
}

export function newConversation() {
  return {
    id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`,
    title: "New chat",
    updated: Date.now(),
    messages: [],
  };
}
