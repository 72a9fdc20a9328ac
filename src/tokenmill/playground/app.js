// tokenmill playground: plain JavaScript, no build step. Talks to the same OpenAI
// routes any client uses; streaming is read with fetch + ReadableStream so the
// Stop button can abort it (the server then stops generating and frees the slot).
"use strict";

const DEFAULTS = {
  max_tokens: "256",
  temperature: "0.7",
  top_p: "1",
  top_k: "0",
  frequency_penalty: "0",
  presence_penalty: "0",
  seed: "",
  stop: "",
  system: "",
  chat_template: "",
};
const NUMBER_FIELDS = [
  "max_tokens",
  "temperature",
  "top_p",
  "top_k",
  "frequency_penalty",
  "presence_penalty",
  "seed",
];

const $ = (id) => document.getElementById(id);
const state = { history: [], controller: null };

// -- settings ---------------------------------------------------------------------

function resetSettings() {
  for (const [id, value] of Object.entries(DEFAULTS)) $(id).value = value;
  $("stream").checked = true;
  $("multiturn").checked = true;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function endpointPath() {
  return $("endpoint").value === "chat" ? "/v1/chat/completions" : "/v1/completions";
}

// The request body for `text` (the new user turn), from the current settings.
function buildBody(text) {
  const body = { model: $("model").value };
  for (const id of NUMBER_FIELDS) {
    const raw = $(id).value.trim();
    // Sent as typed (2.5 for top k, or text): the server names what is wrong.
    if (raw !== "") body[id] = Number.isNaN(Number(raw)) ? raw : Number(raw);
  }
  const stops = $("stop").value.split("\n").filter((s) => s !== "");
  if (stops.length) body.stop = stops;
  const stream = $("stream").checked;
  body.stream = stream;
  if (stream) body.stream_options = { include_usage: true };
  if ($("endpoint").value === "chat") {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    if ($("multiturn").checked) messages.push(...state.history);
    messages.push({ role: "user", content: text });
    body.messages = messages;
    const template = $("chat_template").value;
    if (template.trim()) body.chat_template = template;
  } else {
    body.prompt = text;
  }
  return body;
}

function shellQuote(s) {
  return `'${s.replace(/'/g, `'\\''`)}'`;
}

// The current request as a curl command; the key stays in an environment variable
// so it never lands in the clipboard or shell history.
function curlCommand(text) {
  const body = buildBody(text);
  const lines = [`curl${body.stream ? " -N" : ""} ${shellQuote(location.origin + endpointPath())}`];
  lines.push(`  -H 'Content-Type: application/json'`);
  if ($("api-key").value.trim()) lines.push(`  -H "Authorization: Bearer $TOKENMILL_API_KEY"`);
  lines.push(`  -d ${shellQuote(JSON.stringify(body))}`);
  return lines.join(" \\\n");
}

async function copyCurl() {
  const cmd = curlCommand($("prompt").value || "Hello!");
  const pre = $("curl");
  pre.textContent = cmd;
  pre.hidden = false;
  try {
    await navigator.clipboard.writeText(cmd);
    pre.dataset.copied = "yes";
  } catch {
    // No clipboard outside secure contexts: the command is shown to copy by hand.
    pre.dataset.copied = "no";
  }
}

// -- errors -----------------------------------------------------------------------

function sentence(text) {
  const t = String(text || "").trim();
  if (!t) return "";
  const s = t[0].toUpperCase() + t.slice(1);
  return /[.!?]$/.test(s) ? s : `${s}.`;
}

// One plain sentence for an OpenAI error body (or whatever the server sent).
function describeError(status, body, retryAfter) {
  const msg = sentence(body && body.error && body.error.message);
  switch (status) {
    case 401:
      return `The API key was not accepted. ${msg || "Enter a valid key above."}`.trim();
    case 402:
      return `The account has no credit left. ${msg}`.trim();
    case 403:
      return `This key may not do that. ${msg}`.trim();
    case 429: {
      const wait = retryAfter ? ` Retry in ${retryAfter} s.` : "";
      return `The server is overloaded. ${msg}${wait}`.trim();
    }
    default:
      if (msg) return msg;
      return status >= 500
        ? `The server failed (HTTP ${status}). Try again.`
        : `The request failed (HTTP ${status}).`;
  }
}

async function errorFromResponse(resp) {
  let body = null;
  try {
    body = await resp.json();
  } catch {
    body = null;
  }
  return describeError(resp.status, body, resp.headers.get("retry-after"));
}

function showError(text) {
  const el = $("error");
  el.textContent = text;
  el.hidden = !text;
}

// -- transcript -------------------------------------------------------------------

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  div.append(who, body);
  $("transcript").append(div);
  div.scrollIntoView({ block: "end" });
  return body;
}

function showStats(s) {
  const el = $("stats");
  el.replaceChildren();
  const add = (name, label) => {
    const span = document.createElement("span");
    span.dataset.stat = name;
    span.textContent = label;
    el.append(span);
  };
  if (s.ttft != null) add("ttft", `TTFT ${Math.round(s.ttft)} ms`);
  if (s.tps != null) add("tps", `${s.tps.toFixed(1)} tokens/s`);
  if (s.usage) {
    add("prompt_tokens", `prompt ${s.usage.prompt_tokens} tokens`);
    add("completion_tokens", `completion ${s.usage.completion_tokens} tokens`);
  }
  if (s.stopped) add("stopped", "stopped");
  el.hidden = el.childElementCount === 0;
  return el;
}

// Cost is known once the gateway has settled the request (metering on).
async function showCost(requestId) {
  if (!requestId) return;
  for (let attempt = 0; attempt < 3; attempt++) {
    let resp;
    try {
      resp = await fetch(`/v1/usage/${encodeURIComponent(requestId)}`, { headers: headers() });
    } catch {
      return;
    }
    if (resp.ok) {
      const body = await resp.json();
      if (typeof body.charged === "number") {
        const span = document.createElement("span");
        span.dataset.stat = "cost";
        span.textContent = `cost ${body.charged} µ`;
        $("stats").append(span);
        $("stats").hidden = false;
      }
      return;
    }
    // 404 for this id: not settled yet, ask again. Any other answer (no usage
    // route, metering off, another account's request): no cost to show.
    if (resp.status !== 404) return;
    const err = await resp.json().catch(() => null);
    if (err && err.error && err.error.code === "unknown_url") return;
    await new Promise((r) => setTimeout(r, 300));
  }
}

// -- generation -------------------------------------------------------------------

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop-btn").disabled = !busy;
}

function deltaOf(event) {
  const choice = event.choices && event.choices[0];
  if (!choice) return "";
  if (choice.delta) return choice.delta.content || "";
  return choice.text || "";
}

// Yield each SSE `data:` payload of a fetch response as it arrives.
async function* sseEvents(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += value;
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = frame
        .split("\n")
        .filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart())
        .join("\n");
      if (data) yield data;
    }
  }
}

async function send(text) {
  showError("");
  const body = buildBody(text);
  const userRole = $("endpoint").value === "chat" ? "user" : "prompt";
  addMessage(userRole, text);
  const out = addMessage($("endpoint").value === "chat" ? "assistant" : "completion", "");
  out.parentElement.classList.add("pending");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const t0 = performance.now();
  let tFirst = null;
  let usage = null;
  let requestId = null;
  let stopped = false;
  let failed = false;
  try {
    const resp = await fetch(endpointPath(), {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    requestId = resp.headers.get("x-request-id");
    if (!resp.ok) {
      failed = true;
      showError(await errorFromResponse(resp));
    } else if (body.stream) {
      for await (const data of sseEvents(resp)) {
        if (data === "[DONE]") break;
        const event = JSON.parse(data);
        if (event.error) {
          failed = true;
          showError(describeError(500, event));
          break;
        }
        const delta = deltaOf(event);
        if (delta) {
          if (tFirst === null) tFirst = performance.now();
          out.textContent += delta;
        }
        if (event.usage) usage = event.usage;
      }
    } else {
      const event = await resp.json();
      tFirst = performance.now();
      const choice = event.choices[0];
      out.textContent = choice.message ? choice.message.content : choice.text;
      usage = event.usage;
    }
  } catch (e) {
    if (e.name === "AbortError") {
      stopped = true;
    } else {
      failed = true;
      showError(`Could not reach the server: ${sentence(e.message)}`);
    }
  } finally {
    state.controller = null;
    setBusy(false);
    out.parentElement.classList.remove("pending");
  }
  const tEnd = performance.now();
  if (failed && !out.textContent) out.parentElement.remove();
  if ($("endpoint").value === "chat" && !failed) {
    state.history.push({ role: "user", content: text });
    state.history.push({ role: "assistant", content: out.textContent });
  }
  if (failed) return;
  const stats = { stopped, usage, ttft: tFirst === null ? null : tFirst - t0, tps: null };
  if (usage && tFirst !== null) {
    // Streaming: the decode rate after the first token; one JSON body: overall.
    const span = (body.stream ? tEnd - tFirst : tEnd - t0) / 1000;
    const n = body.stream ? usage.completion_tokens - 1 : usage.completion_tokens;
    if (span > 0 && n > 0) stats.tps = n / span;
  }
  showStats(stats);
  if (!stopped) await showCost(requestId);
}

// -- start ------------------------------------------------------------------------

async function loadModels() {
  const select = $("model");
  let resp;
  try {
    resp = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    showError(`Could not reach the server: ${sentence(e.message)}`);
    return;
  }
  if (!resp.ok) {
    showError(await errorFromResponse(resp));
    return;
  }
  const previous = select.value;
  const { data } = await resp.json();
  select.replaceChildren(
    ...data.map((m) => {
      const o = document.createElement("option");
      o.value = m.id;
      o.textContent = m.id;
      return o;
    }),
  );
  if (data.some((m) => m.id === previous)) select.value = previous;
  showError("");
  document.body.dataset.ready = "yes";
}

function init() {
  resetSettings();
  const saved = sessionStorage.getItem("tokenmill-api-key");
  if (saved) $("api-key").value = saved;
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem("tokenmill-api-key", $("api-key").value.trim());
    loadModels();
  });
  $("reset").addEventListener("click", resetSettings);
  $("endpoint").addEventListener("change", () => {
    document.body.dataset.endpoint = $("endpoint").value;
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("composer").requestSubmit();
  });
  $("stop-btn").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
  });
  $("new-chat").addEventListener("click", () => {
    state.history = [];
    $("transcript").replaceChildren();
    $("stats").hidden = true;
    showError("");
  });
  $("copy-curl").addEventListener("click", copyCurl);
  document.body.dataset.endpoint = $("endpoint").value;
  loadModels();
}

init();
