// A small Markdown renderer that builds DOM nodes and never parses HTML.
//
// Model output is untrusted: every piece of text goes into the page through
// textContent / createTextNode, so `<script>` or `<img onerror>` in an answer
// shows up as those characters, never as elements. Links keep only http(s)
// and mailto targets; images are shown as links (no request to a third party).
//
// Supported: paragraphs, # headings, ``` fenced code, `inline code`,
// **bold**, *italic*, [links](url), - and 1. lists, > quotes, --- rules.

const SAFE_URL = /^(https?:|mailto:)/i;

function inline(text, parent) {
  // One pass left to right: find the earliest token, emit text before it.
  const patterns = [
    ["code", /`([^`\n]+)`/],
    ["image", /!\[([^\]\n]*)\]\(([^)\s]+)\)/],
    ["link", /\[([^\]\n]+)\]\(([^)\s]+)\)/],
    // Underscores only at word edges: snake_case_names stay as they are.
    ["strong", /\*\*([^*\n]+)\*\*|(?<!\w)__([^_\n]+)__(?!\w)/],
    ["em", /\*([^*\n]+)\*|(?<!\w)_([^_\n]+)_(?!\w)/],
  ];
  let rest = text;
  while (rest) {
    let best = null;
    for (const [kind, re] of patterns) {
      const m = re.exec(rest);
      if (m && (best === null || m.index < best.m.index)) best = { kind, m };
    }
    if (best === null) {
      parent.append(document.createTextNode(rest));
      return;
    }
    const { kind, m } = best;
    if (m.index > 0) parent.append(document.createTextNode(rest.slice(0, m.index)));
    if (kind === "code") {
      const el = document.createElement("code");
      el.textContent = m[1];
      parent.append(el);
    } else if (kind === "link" || kind === "image") {
      const label = m[1] || m[2];
      if (SAFE_URL.test(m[2])) {
        const a = document.createElement("a");
        a.href = m[2];
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        inline(kind === "image" ? `[image: ${label}]` : label, a);
        parent.append(a);
      } else {
        parent.append(document.createTextNode(m[0]));
      }
    } else {
      const el = document.createElement(kind);
      inline(m[1] ?? m[2], el);
      parent.append(el);
    }
    rest = rest.slice(m.index + m[0].length);
  }
}

function paragraph(lines, parent) {
  const p = document.createElement("p");
  lines.forEach((line, i) => {
    if (i > 0) p.append(document.createElement("br"));
    inline(line, p);
  });
  parent.append(p);
}

const FENCE = /^\s*```/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;

/**
 * Render `text` as Markdown into a new DocumentFragment.
 * An unclosed code fence (a stream still arriving) runs to the end.
 */
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  let para = [];
  const flush = () => {
    if (para.length) paragraph(para, out);
    para = [];
  };
  while (i < lines.length) {
    const line = lines[i];
    if (FENCE.test(line)) {
      flush();
      const lang = line.trim().slice(3).trim();
      const body = [];
      i++;
      while (i < lines.length && !FENCE.test(lines[i])) body.push(lines[i++]);
      i++; // the closing fence
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      if (lang) code.dataset.lang = lang;
      code.textContent = body.join("\n");
      pre.append(code);
      out.append(pre);
      continue;
    }
    let m;
    if (!line.trim()) {
      flush();
    } else if ((m = HEADING.exec(line))) {
      flush();
      const h = document.createElement(`h${Math.min(6, m[1].length + 2)}`);
      inline(m[2], h);
      out.append(h);
    } else if (RULE.test(line)) {
      flush();
      out.append(document.createElement("hr"));
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      flush();
      const ordered = !BULLET.test(line);
      const re = ordered ? NUMBERED : BULLET;
      const list = document.createElement(ordered ? "ol" : "ul");
      while (i < lines.length && (m = re.exec(lines[i]))) {
        const li = document.createElement("li");
        inline(m[1], li);
        list.append(li);
        i++;
      }
      out.append(list);
      continue;
    } else if (QUOTE.test(line)) {
      flush();
      const quoted = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        quoted.push(m[1]);
        i++;
      }
      const bq = document.createElement("blockquote");
      bq.append(renderMarkdown(quoted.join("\n")));
      out.append(bq);
      continue;
    } else {
      para.push(line);
    }
    i++;
  }
  flush();
  return out;
}
