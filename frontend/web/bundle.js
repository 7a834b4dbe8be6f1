// The page's entry module: tabs, the API-key form, and the two views.

import { provideKey } from "./web/api.js";
import { ChatView } from "./web/chat.js";
import { PoolView } from "./web/pool.js";
import { setApiKey } from "./web/store.js";

const $ = (id) => document.getElementById(id);

function selectTab(name) {
  for (const view of ["chat", "pool"]) {
    const selected = view === name;
    $(`tab-${view}`).setAttribute("aria-selected", String(selected));
    $(`view-${view}`).hidden = !selected;
  }
  pool.show(name === "pool");
  if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  $("key-input").value = "";
  provideKey(key);
});

$("forget-key").addEventListener("click", () => setApiKey(""));

const chat = new ChatView();
const pool = new PoolView();
$("tab-chat").addEventListener("click", () => selectTab("chat"));
$("tab-pool").addEventListener("click", () => selectTab("pool"));
selectTab(location.hash === "#pool" ? "pool" : "chat");
pool.start();
document.documentElement.dataset.ready = "true";
// For tests and the console: the page's live objects.
window.llamapool = { chat, pool };
