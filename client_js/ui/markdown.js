// Safe Markdown for model output: the text is parsed here and turned into DOM nodes built with
// createElement/createTextNode only. No HTML from the model ever reaches a parser (no innerHTML), so
// `<img src=x onerror=...>` in a reply is shown as those characters. Links are made only for http(s)
// and mailto URLs; images are shown as links (nothing is loaded from a URL the model chose).
//
// Supported: paragraphs (single newlines kept as line breaks), ATX headings, fenced code blocks (an
// unclosed fence, while a reply streams, renders as code so far), block quotes, bullet and numbered
// lists, horizontal rules, inline code, **bold**, *italic*/_italic_, ~~strike~~, [links](https://…),
// bare https:// URLs, backslash escapes.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const BULLET = /^ {0,3}[-*+]\s+(.*)$/;
const ORDERED = /^ {0,3}(\d{1,9})[.)]\s+(.*)$/;
const SAFE_URL = /^(https?:\/\/|mailto:)[^\s<>"]+$/i;
const BARE_URL = /^https?:\/\/[^\s<>"'()[\]]+[^\s<>"'()[\].,;:!?]/i;

/** Render Markdown `text` into a DocumentFragment of `doc`. */
export function renderMarkdown(text, doc = document) {
  const frag = doc.createDocumentFragment();
  renderBlocks(String(text).replace(/\r\n?/g, "\n").split("\n"), frag, doc, 0);
  return frag;
}

function isBlockStart(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || BULLET.test(line) || ORDERED.test(line);
}

function renderBlocks(lines, parent, doc, depth) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i++;
      continue;
    }
    let m;
    if ((m = FENCE.exec(line))) {
      const fence = m[1];
      const code = [];
      i++;
      while (i < lines.length && !new RegExp(`^ {0,3}${fence[0]}{${fence.length},}\\s*$`).test(lines[i])) code.push(lines[i++]);
      i++; // the closing fence (or past the end while still streaming)
      const pre = el(doc, "pre");
      const c = el(doc, "code");
      if (m[2]) c.className = `language-${m[2].replace(/[^\w+#-]/g, "")}`;
      c.textContent = code.join("\n");
      pre.appendChild(c);
      parent.appendChild(pre);
    } else if ((m = HEADING.exec(line))) {
      const h = el(doc, `h${Math.min(6, m[1].length + 2)}`); // h3-h6 under the page's own headings
      renderInline(m[2], h, doc);
      parent.appendChild(h);
      i++;
    } else if (RULE.test(line)) {
      parent.appendChild(el(doc, "hr"));
      i++;
    } else if (QUOTE.test(line) && depth < 8) {
      const inner = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        inner.push(m[1]);
        i++;
      }
      const q = el(doc, "blockquote");
      renderBlocks(inner, q, doc, depth + 1);
      parent.appendChild(q);
    } else if (BULLET.test(line) || ORDERED.test(line)) {
      const ordered = !BULLET.test(line);
      const re = ordered ? ORDERED : BULLET;
      const list = el(doc, ordered ? "ol" : "ul");
      if (ordered) {
        const start = Number(ORDERED.exec(line)[1]);
        if (start !== 1) list.start = start;
      }
      while (i < lines.length && (m = re.exec(lines[i]))) {
        const item = [ordered ? m[2] : m[1]];
        i++;
        // Indented lines continue the item.
        while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !re.test(lines[i])) item.push(lines[i++].trim());
        const li = el(doc, "li");
        renderLines(item, li, doc);
        list.appendChild(li);
      }
      parent.appendChild(list);
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() && !(para.length && isBlockStart(lines[i]))) para.push(lines[i++]);
      const p = el(doc, "p");
      renderLines(para, p, doc);
      parent.appendChild(p);
    }
  }
}

function renderLines(lines, parent, doc) {
  lines.forEach((l, k) => {
    if (k) parent.appendChild(el(doc, "br"));
    renderInline(l, parent, doc);
  });
}

function el(doc, tag) {
  return doc.createElement(tag);
}

/** Inline Markdown of one line into `parent`, as text nodes and a few safe elements. */
export function renderInline(s, parent, doc = document, inLink = false) {
  let buf = "";
  const flush = () => {
    if (buf) parent.appendChild(doc.createTextNode(buf));
    buf = "";
  };
  let i = 0;
  while (i < s.length) {
    const c = s[i];
    const rest = s.slice(i);
    let m;
    if (c === "\\" && i + 1 < s.length && /[\\`*_{}[\]()#+\-.!~>|<]/.test(s[i + 1])) {
      buf += s[i + 1];
      i += 2;
    } else if (c === "`" && (m = /^(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.exec(rest))) {
      flush();
      const code = el(doc, "code");
      code.textContent = m[2].length > 2 && m[2].startsWith(" ") && m[2].endsWith(" ") ? m[2].slice(1, -1) : m[2];
      parent.appendChild(code);
      i += m[0].length;
    } else if ((c === "*" || c === "_") && (m = /^(\*\*|__)(?=\S)([\s\S]*?\S)\1/.exec(rest)) && wordEdge(s, i, c)) {
      flush();
      const strong = el(doc, "strong");
      renderInline(m[2], strong, doc, inLink);
      parent.appendChild(strong);
      i += m[0].length;
    } else if ((c === "*" || c === "_") && (m = /^([*_])(?=[^\s*_])([\s\S]*?[^\s\\])\1(?![*_])/.exec(rest)) && wordEdge(s, i, c, m[0].length)) {
      flush();
      const em = el(doc, "em");
      renderInline(m[2], em, doc, inLink);
      parent.appendChild(em);
      i += m[0].length;
    } else if (c === "~" && (m = /^~~(?=\S)([\s\S]*?\S)~~/.exec(rest))) {
      flush();
      const del = el(doc, "del");
      renderInline(m[1], del, doc, inLink);
      parent.appendChild(del);
      i += m[0].length;
    } else if (!inLink && (c === "[" || (c === "!" && s[i + 1] === "[")) && (m = /^!?\[([^\]\n]{1,1000})\]\(\s*<?([^\s)<>]{1,2000})>?(?:\s+"[^"]*")?\s*\)/.exec(rest))) {
      flush();
      const [whole, label, url] = m;
      if (SAFE_URL.test(url)) {
        const a = link(doc, url);
        renderInline(whole.startsWith("!") ? `image: ${label}` : label, a, doc, true);
        parent.appendChild(a);
      } else {
        buf += whole; // not a URL we link to (javascript:, data:, relative...): the characters as written
      }
      i += whole.length;
    } else if (!inLink && (c === "h" || c === "H") && (i === 0 || /[\s(]/.test(s[i - 1])) && (m = BARE_URL.exec(rest))) {
      flush();
      const a = link(doc, m[0]);
      a.textContent = m[0];
      parent.appendChild(a);
      i += m[0].length;
    } else {
      buf += c;
      i++;
    }
  }
  flush();
}

function wordEdge(s, i, c, len = 0) {
  // `_` emphasis only at word edges (snake_case stays as is); `*` anywhere.
  if (c !== "_") return true;
  const before = i > 0 ? s[i - 1] : " ";
  const after = len ? s[i + len] ?? " " : " ";
  return !/\w/.test(before) && !/\w/.test(after);
}

function link(doc, url) {
  const a = el(doc, "a");
  a.href = url;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
  return a;
}
