#!/usr/bin/env node
// Re-checks a loomflow audit export without Python, by the rules of `loomflow audit verify
// --file` (loomflow/audit/offline.py): every line read as strictly as loomflow reads it, each
// user's entries checked in seq order (from 1, no gaps, each linking to the one before) with
// their line numbers as positions, every hash version 2 and 3 entry re-hashed (SHA-256 over its
// RFC 8785 form), and, with a heads file (the output of `loomflow audit verify --json`), each
// saved head reached and holding that very entry. Problems carry the kinds loomflow reports
// (edited, missing, duplicate, reordered, truncated, head_mismatch, unreadable, erased, ...),
// and --json prints the report in the shape of `verify --file --json`, so the two can be
// compared. See docs/audit.md, "Checking an export in another language".
//
//   npm ci --prefix tools && node tools/verify-audit-export.mjs [--json] [--require-v2] [--user ID | --anonymous] EXPORT.jsonl [HEADS.json]
//
// Which users an export covers is the word of whoever runs this, never the file's: without
// --user the export is the whole log, and every user with a saved head must have lines in it
// (else truncated); --user ID (--anonymous: the entries without a user) takes it to be that
// user's trail alone: only that user's lines and saved heads are checked, and a line of
// another user is outside_export. An export made with filters starts with a header line
// naming them ({"filters": {"user_id": "alice"}, "loomflow_audit_export": 1}); no hash covers
// it, so it narrows nothing: a line its filters exclude is outside_export, and a header
// naming a user, read without --user, gets an "unscoped" warning saying which --user to pass.
//
// Hash version 3 entries hash a salted digest of their payload instead of the payload, so a
// payload may be erased ("payload": null) without breaking the chain; an erased payload must be
// covered by an audit.erasure entry of the same user after it (by its cut-off or its list of
// seqs), which for an erased version 1 or 2 entry also keeps the digest of its other fields.
//
// A line with an "unreadable" key is an entry whose stored row loomflow could not read when it
// exported it (the key says why; no hash covers it): it is reported unreadable, in its place,
// and the chain goes on past it, as `loomflow audit verify` reports the row on the store. One
// with an "unreadable" key and no "hash" stands for a row that read as no entry at all: the
// line is unreadable (it says which row and why), and its entry is missing from the chain.
//
// Exit status: 0 intact, 1 a problem found, 2 bad usage or an unreadable file.
// Version 1 entries (written before loomflow 0.21) hash Python's own JSON spelling, which
// JavaScript cannot rebuild from parsed values (5.0 and 5 both parse to 5): their links are
// checked, their content is not, and the summary counts them. --require-v2 makes them fail
// (kind "version_1", which only this verifier reports), as is, always, one after an entry of
// a later version in its trail: relabelled, its edited payload would otherwise pass here.

import { createHash } from 'node:crypto';
import { createReadStream, openSync, readFileSync } from 'node:fs';
import { createInterface } from 'node:readline';
import canonicalize from 'canonicalize';

const GENESIS = '0'.repeat(64);
const DIGESTED_VERSION = 3;
const ENTRY_SCHEMA_VERSION = 1; // the entry layout (loomflow's ENTRY_SCHEMA_VERSION)
// The first line of an export made with filters: {"filters": {...}, "loomflow_audit_export": 1}.
const EXPORT_HEADER = 'loomflow_audit_export';
const EXPORT_FILTERS = ['user_id', 'session_id', 'run_id', 'action', 'since', 'until', 'after_seq'];
// The key of a line whose stored row the exporter could not read (a payload that is no strict
// JSON, a row no writer makes): the line says why, and the entry is unreadable where it is.
const UNREADABLE = 'unreadable';
const AUDIT_ERASURE = 'audit.erasure';
const HOLD_PLACED = 'legal_hold.placed';
const HOLD_ACTIONS = [HOLD_PLACED, 'legal_hold.released'];
const AUDIT_DELETION = 'audit.deletion';
const AUDIT_DELETION_START = 'audit.deletion.start';
// Erasure never takes their payloads (loomflow.audit.actions.KEPT_BY_ERASURE).
const KEPT_BY_ERASURE = [AUDIT_ERASURE, AUDIT_DELETION, AUDIT_DELETION_START, ...HOLD_ACTIONS];

const usage = 'usage: verify-audit-export.mjs [--json] [--require-v2] [--user ID | --anonymous] ' +
  'EXPORT.jsonl [HEADS.json]';
const args = process.argv.slice(2);
let asJson = false;
let requireV2 = false;
let onlyUser; // --user (--anonymous: null): the export is this user's trail alone
let chosen = 0; // how many of --user and --anonymous were given
const positional = [];
for (let i = 0; i < args.length; i += 1) {
  const arg = args[i];
  if (arg === '--json') asJson = true;
  else if (arg === '--require-v2') requireV2 = true;
  else if (arg === '--user' && i + 1 < args.length) [onlyUser, chosen] = [args[(i += 1)], chosen + 1];
  else if (arg.startsWith('--user=')) [onlyUser, chosen] = [arg.slice('--user='.length), chosen + 1];
  else if (arg === '--anonymous') [onlyUser, chosen] = [null, chosen + 1];
  else if (arg.startsWith('--')) {
    console.error(`unknown option ${arg}\n${usage}`);
    process.exit(2);
  } else positional.push(arg);
}
const [exportPath, headsPath, ...extra] = positional;
if (!exportPath || extra.length || chosen > 1) {
  console.error(chosen > 1 ? `one of --user and --anonymous, once\n${usage}` : usage);
  process.exit(2);
}
const onlyKey = onlyUser === undefined ? undefined : JSON.stringify(onlyUser);

// Python's str.strip() whitespace: a line of nothing else is skipped, as loomflow skips it.
const BLANK = /^[\t\n\v\f\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]*$/;
const sha256 = (text) => createHash('sha256').update(text, 'utf8').digest('hex');
// user_key() of loomflow: the JSON text of the user id (null is the anonymous bucket).
const keyOf = (userId) => JSON.stringify(userId);
const span = (first, last) => (first === last ? `entry ${first}` : `entries ${first}-${last}`);

// -- the report, in the shape of loomflow's VerifyReport.to_json() -----------------------------

const report = { users: 0, entries: 0, erased: 0, problems: [], warnings: [], heads: [] };
let exportFilters = null; // what the export's header says it was made with
const problem = (userId, kind, seq, position, detail) =>
  report.problems.push({ user_id: userId, kind, seq, position, detail });
const warning = (userId, kind, seq, position, detail) =>
  report.warnings.push({ user_id: userId, kind, seq, position, detail });
let rehashed = 0;
let version1 = 0;

// -- saved heads: grouped by user, in the order they first appear ------------------------------

const saved = new Map();
// Heads given (even none: saved from an empty or another log): a user none covers is warned of.
let headsGiven = false;
if (headsPath) {
  try {
    const data = JSON.parse(readFileSync(headsPath, 'utf8'));
    const items = Array.isArray(data) ? data : data?.heads;
    if (!Array.isArray(items)) throw new Error('not a `verify --json` report (no "heads")');
    headsGiven = true;
    for (const head of items) {
      if (
        typeof head !== 'object' || head === null || !Number.isSafeInteger(head.seq) ||
        head.seq < 1 ||
        typeof head.hash !== 'string' ||
        !(head.user_id === undefined || head.user_id === null || typeof head.user_id === 'string')
      ) {
        throw new Error(`not a chain head: ${JSON.stringify(head)}`);
      }
      const userId = head.user_id ?? null;
      const key = keyOf(userId);
      if (onlyKey !== undefined && key !== onlyKey) continue;
      saved.set(key, [...(saved.get(key) ?? []), { user_id: userId, seq: head.seq, hash: head.hash }]);
    }
  } catch (err) {
    console.error(`cannot read the heads ${headsPath}: ${err.message}`);
    process.exit(2);
  }
}

// -- reading a line as loomflow does (AuditEntry.from_line) -----------------------------------

const FIELDS = new Set([
  'schema_version', 'hash_version', 'user_id', 'seq', 'time', 'session_id', 'run_id', 'actor',
  'action', 'payload', 'payload_digest', 'payload_salt', 'prev_hash', 'hash',
  'time_us', // replaced by the one read from "time", as loomflow does
  UNREADABLE,
]);
const INTEGERS = ['schema_version', 'hash_version', 'seq'];
const INTEGER_TEXT = /^-?(0|[1-9][0-9]*)$/;
// Where the JSON string opening at text[start] ends (the index past its closing quote). Only
// called on text JSON.parse accepted. Not a regular expression: one alternation per character
// overflowed the stack on a text of some megabytes, making an intact entry "unreadable".
function stringEnd(text, start) {
  let at = start + 1;
  for (;;) {
    const quote = text.indexOf('"', at);
    if (quote === -1) return text.length; // unclosed: JSON.parse refused it already
    let slashes = 0;
    while (text[quote - 1 - slashes] === '\\') slashes += 1;
    if (slashes % 2 === 0) return quote + 1; // not escaped
    at = quote + 1;
  }
}

// The text of each top-level value of a JSON object, by key (the last one wins, as in
// JSON.parse): JSON.parse reads 4.0 as 4, but loomflow, reading the number as written, refuses
// a seq that is not spelled as an integer. Only called on text JSON.parse accepted.
function topLevelTexts(text) {
  const texts = new Map();
  let at = text.indexOf('{') + 1;
  const skipSpace = () => {
    while (' \t\r\n'.includes(text[at]) && at < text.length) at += 1;
  };
  const string = () => {
    const end = stringEnd(text, at);
    const found = text.slice(at, end);
    at = end;
    return found;
  };
  for (;;) {
    skipSpace();
    if (text[at] === '}') return texts;
    const key = JSON.parse(string());
    skipSpace();
    at += 1; // the colon
    skipSpace();
    const start = at;
    if (text[at] === '"') {
      string();
    } else if (text[at] === '{' || text[at] === '[') {
      let depth = 0;
      do {
        if (text[at] === '"') {
          string();
          continue;
        }
        if (text[at] === '{' || text[at] === '[') depth += 1;
        if (text[at] === '}' || text[at] === ']') depth -= 1;
        at += 1;
      } while (depth > 0);
    } else {
      while (at < text.length && !',}'.includes(text[at]) && !' \t\r\n'.includes(text[at])) at += 1;
    }
    texts.set(key, text.slice(start, at));
    skipSpace();
    if (text[at] === ',') at += 1;
  }
}

// What JSON.parse lets through and loomflow refuses (its read_json): a key given twice in one
// object, at any depth (JSON.parse keeps the last value, SQLite's json_extract the first, so
// one text would be two entries), a number with a fraction or exponent beyond a double's
// range (JSON.parse reads 1e400 as Infinity), or an integer of more digits than Python reads
// (4300), or text nested more than MAX_JSON_DEPTH deep. Only called on text JSON.parse
// accepted.
//
// Returns the integers written beyond 2**53 - 1 (either sign), each with its path of keys and
// list indexes: JSON.parse rounds them (100000000000000000001 becomes 1e20), where loomflow
// keeps them exact and, as RFC 8785 has no form for them, cannot hash them. See
// firstUnsafeInteger.
const NUMBER = /-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/y;
const PYTHON_MAX_DIGITS = 4300; // sys.get_int_max_str_digits(): json.loads refuses more
// loomflow's MAX_JSON_DEPTH: Python's parser recurses, so loomflow refuses text nested deeper
// than this (JSON.parse reads any depth), and so does this verifier, the same way.
const MAX_JSON_DEPTH = 256;
function tooDeep(depth) {
  if (depth > MAX_JSON_DEPTH) {
    throw new Error(`it is nested more than ${MAX_JSON_DEPTH} lists and objects deep`);
  }
}
function checkStrict(text) {
  const open = []; // the keys of each object open around `at` (null for a list), innermost last
  const path = []; // the key or list index of the value being read, in each open container
  const unsafe = [];
  let keyNext = false; // the next string is a key
  let at = 0;
  while (at < text.length) {
    const c = text[at];
    if (c === '"') {
      const end = stringEnd(text, at);
      const found = text.slice(at, end);
      at = end;
      const keys = open[open.length - 1];
      if (keyNext && keys) {
        const key = JSON.parse(found);
        if (keys.has(key)) {
          throw new Error(`the key ${JSON.stringify(key).slice(0, 80)} is given twice in one object`);
        }
        keys.add(key);
        path[path.length - 1] = key;
      }
      keyNext = false;
      continue;
    }
    if (c === '-' || (c >= '0' && c <= '9')) {
      NUMBER.lastIndex = at;
      const number = NUMBER.exec(text)[0];
      at = NUMBER.lastIndex;
      if (/[.eE]/.test(number)) {
        if (!Number.isFinite(Number(number))) {
          throw new Error(`the number ${number.slice(0, 40)} is beyond the range of JSON readers`);
        }
      } else if (number.replace('-', '').length > PYTHON_MAX_DIGITS) {
        throw new Error(`the integer ${number.slice(0, 40)}... has more than ${PYTHON_MAX_DIGITS} digits`);
      } else if (!Number.isSafeInteger(Number(number))) {
        unsafe.push({ path: [...path], text: number });
      }
      continue;
    }
    if (c === '{') {
      open.push(new Set());
      path.push(undefined);
      keyNext = true;
      tooDeep(open.length);
    } else if (c === '[' || c === '}' || c === ']') {
      if (c === '[') {
        open.push(null);
        path.push(0);
        tooDeep(open.length);
      } else {
        open.pop();
        path.pop();
      }
      keyNext = false;
    } else if (c === ',') {
      keyNext = open[open.length - 1] !== null;
      if (!keyNext) path[path.length - 1] += 1;
    } else if (c === ':') {
      keyNext = false;
    } // whitespace, and the letters of true, false and null, change nothing
    at += 1;
  }
  return unsafe;
}

// Of the integers checkStrict found beyond 2**53 - 1, the text of the first one under the
// line's top-level keys `within` that RFC 8785 meets, walking keys in its order (UTF-16
// units, as JavaScript sorts) and lists in theirs: the one loomflow's canonicalizer names
// when it refuses to hash them. Undefined when they hold none.
function firstUnsafeInteger(unsafe, within) {
  const before = (a, b) => {
    for (let i = 0; i < Math.min(a.length, b.length); i += 1) {
      if (a[i] !== b[i]) return a[i] < b[i];
    }
    return a.length < b.length;
  };
  let first;
  for (const found of unsafe) {
    if (!within.includes(found.path[0])) continue;
    if (first === undefined || before(found.path, first.path)) first = found;
  }
  return first?.text;
}
const noCanonicalForm = (version, text) =>
  `no canonical JSON (hash version ${version}): ${text} exceeds safe integer domain for JSON floats`;

const TIME = /^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})\.(\d{6})Z$/;

// loomflow's time_us_of_text: exactly YYYY-MM-DDTHH:MM:SS.ffffffZ, a real date, year 1 on (an
// export made with --since 0001-01-01 says so in its header).
function checkTime(text) {
  if (typeof text !== 'string' || !text.endsWith('Z')) {
    throw new Error(`bad time ${JSON.stringify(text)}`);
  }
  const parts = TIME.exec(text);
  const [year, month, day, hour, minute, second] = (parts ?? []).slice(1, 7).map(Number);
  const leap = year % 4 === 0 && (year % 100 !== 0 || year % 400 === 0);
  const days = [31, leap ? 29 : 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][month - 1];
  if (
    !parts || year < 1 || days === undefined || day < 1 || day > days ||
    hour > 23 || minute > 59 || second > 59
  ) {
    throw new Error(`time ${JSON.stringify(text)} is not spelled YYYY-MM-DDTHH:MM:SS.ffffffZ`);
  }
}

const isText = (value) => typeof value === 'string';
const isTextOrNull = (value) => value === null || typeof value === 'string';

// The filters an export's first line names (loomflow's read_export_header): null when the
// line is not a header; an Error when it is one (it has the header's key) that cannot be read.
function readHeader(line) {
  let data;
  try {
    data = JSON.parse(line);
    checkStrict(line); // a header with a key twice is no header (nor an entry)
  } catch {
    return null;
  }
  if (typeof data !== 'object' || data === null || Array.isArray(data) || !Object.hasOwn(data, EXPORT_HEADER)) {
    return null;
  }
  if (topLevelTexts(line).get(EXPORT_HEADER) !== '1') {
    throw new Error(`format ${JSON.stringify(data[EXPORT_HEADER])}, where this verifier reads 1`);
  }
  const extraKeys = Object.keys(data).filter((k) => k !== EXPORT_HEADER && k !== 'filters');
  if (extraKeys.length) throw new Error(`it has ${extraKeys.join(', ')}`);
  const { filters } = data;
  if (typeof filters !== 'object' || filters === null || Array.isArray(filters)) {
    throw new Error('its filters are not an object');
  }
  for (const [name, value] of Object.entries(filters)) {
    if (!EXPORT_FILTERS.includes(name)) throw new Error(`unknown filter ${name}`);
    if (typeof value !== 'string' && !(name === 'user_id' && value === null)) {
      throw new Error(`filter ${name} is ${JSON.stringify(value)}, not text`);
    }
    // As loomflow's exporter checked them: a line is compared with them.
    if (name === 'since' || name === 'until') checkTime(value);
    else if (name === 'after_seq') {
      if (!/^[0-9]{1,19}$/.test(value)) throw new Error(`filter after_seq is ${JSON.stringify(value)}, not an entry number`);
    } else if (value !== null) checkId(name, value, name === 'action' ? MAX_KEY_BYTES : MAX_ID_BYTES);
  }
  return filters;
}

// loomflow's check_id (check_key for an action): not empty, a UTF-8 form of at most `limit`
// bytes (no lone surrogate), no control character (Unicode category Cc).
const MAX_ID_BYTES = 256;
const MAX_KEY_BYTES = 2048;
const LONE_SURROGATE = /[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/;
const CONTROL = /[\x00-\x1f\x7f-\x9f]/;
function checkId(name, value, limit) {
  if (!value) throw new Error(`${name} must not be empty`);
  if (LONE_SURROGATE.test(value)) throw new Error(`${name} holds a lone surrogate`);
  const size = Buffer.byteLength(value, 'utf8');
  if (size > limit) throw new Error(`${name} is ${size} bytes long in UTF-8, over ${limit}`);
  if (CONTROL.test(value)) throw new Error(`${name} contains a control character`);
}

// Why the export should not hold an entry (loomflow's _outside_reasons): not the user it is
// checked as (--user), or excluded by a filter its header names. Empty: it belongs.
const trailOf = (userId) => (userId === null ? "the anonymous bucket's trail" : `the trail of ${keyOf(userId)}`);
const optionFor = (userId) => (userId === null ? '--anonymous' : `--user ${keyOf(userId)}`);
function outsideReasons(entry, key) {
  const reasons = [];
  if (onlyKey !== undefined && key !== onlyKey) {
    reasons.push(`it is checked as ${trailOf(onlyUser)} alone (${optionFor(onlyUser)})`);
  }
  for (const [name, value] of Object.entries(exportFilters ?? {})) {
    let kept;
    if (name === 'user_id') kept = key === keyOf(value);
    else if (name === 'session_id') kept = entry.session_id === value;
    else if (name === 'run_id') kept = entry.run_id === value;
    else if (name === 'action') {
      kept = value.endsWith('*') ? entry.action.startsWith(value.slice(0, -1)) : entry.action === value;
    } else if (name === 'since') kept = entry.time >= value; // fixed-width: text order is time order
    else if (name === 'after_seq') kept = BigInt(entry.seq) > BigInt(value);
    else kept = entry.time < value; // until
    if (!kept) reasons.push(`its header says ${name} ${keyOf(value)}`);
  }
  return reasons;
}

// The entry on a line, or an Error saying why the line is not one (loomflow: "unreadable").
function readEntry(line) {
  const data = JSON.parse(line); // NaN and Infinity are not JSON, here as in loomflow
  const unsafe = checkStrict(line);
  if (typeof data !== 'object' || data === null || Array.isArray(data)) {
    throw new Error(`a JSON ${Array.isArray(data) ? 'list' : typeof data}, not an object`);
  }
  if (UNREADABLE in data && !('hash' in data)) {
    // The marker loomflow exports for a row that read as no entry: the line says which and why.
    throw new Error(`a row the exporter could not read: ${JSON.stringify(data[UNREADABLE]).slice(0, 200)}`);
  }
  if (!('time' in data) || data.time === null) throw new Error('no time');
  checkTime(data.time);
  const texts = topLevelTexts(line);
  const wrong = [];
  for (const key of Object.keys(data)) if (!FIELDS.has(key)) wrong.push(`${key}: not a field`);
  for (const key of INTEGERS) {
    if (key in data && !INTEGER_TEXT.test(texts.get(key) ?? '')) wrong.push(`${key}: not an integer`);
  }
  for (const key of ['user_id', 'seq', 'actor', 'action', 'prev_hash', 'hash']) {
    if (!(key in data)) wrong.push(`${key}: missing`);
  }
  if ('user_id' in data && !isTextOrNull(data.user_id)) wrong.push('user_id: not text or null');
  for (const key of ['actor', 'action', 'prev_hash', 'hash']) {
    if (key in data && !isText(data[key])) wrong.push(`${key}: not text`);
  }
  for (const key of ['session_id', 'run_id', 'payload_digest', 'payload_salt']) {
    if (key in data && !isTextOrNull(data[key])) wrong.push(`${key}: not text or null`);
  }
  if (UNREADABLE in data && !isText(data[UNREADABLE])) wrong.push(`${UNREADABLE}: not text`);
  if ('payload' in data && data.payload !== null &&
      (typeof data.payload !== 'object' || Array.isArray(data.payload))) {
    wrong.push('payload: not an object or null');
  }
  if ('seq' in data && INTEGER_TEXT.test(texts.get('seq') ?? '')) {
    const seq = BigInt(texts.get('seq'));
    if (seq < 1n || seq > BigInt(Number.MAX_SAFE_INTEGER)) wrong.push(`seq: ${seq} is not from 1 to 2**53 - 1`);
  }
  if (wrong.length) throw new Error(wrong.join('; '));
  const entry = {
    schema_version: data.schema_version ?? 1,
    hash_version: data.hash_version ?? 1,
    user_id: data.user_id,
    seq: data.seq,
    time: data.time,
    session_id: data.session_id ?? null,
    run_id: data.run_id ?? null,
    actor: data.actor,
    action: data.action,
    payload: 'payload' in data ? data.payload : {},
    payload_digest: data.payload_digest ?? null,
    payload_salt: data.payload_salt ?? null,
    prev_hash: data.prev_hash,
    hash: data.hash,
  };
  // Not a field: the integers JSON.parse rounded, which loomflow cannot hash.
  Object.defineProperty(entry, 'unsafe', { value: unsafe });
  // ...and hash_version and schema_version as written, for the report (18446744073709551616,
  // not ...552000).
  Object.defineProperty(entry, 'versionText', { value: texts.get('hash_version') ?? '1' });
  Object.defineProperty(entry, 'schemaText', { value: texts.get('schema_version') ?? '1' });
  if (UNREADABLE in data) {
    // However its row was damaged (a version relabelled, a digest dropped): reported as that.
    Object.defineProperty(entry, 'unreadable', { value: data[UNREADABLE] });
    return entry;
  }
  if (entry.hash_version < DIGESTED_VERSION &&
      (entry.payload_digest !== null || entry.payload_salt !== null)) {
    throw new Error(`a hash version ${entry.hash_version} entry has no payload_digest or salt`);
  }
  if (entry.hash_version === DIGESTED_VERSION && !isText(entry.payload_digest)) {
    throw new Error(`a hash version ${entry.hash_version} entry needs a payload_digest`);
  }
  return entry;
}

// What the entry's hash covers (AuditEntry._hashed): every field but the hash, version 1
// without its hash_version, version 3 with the payload's digest in place of the payload.
function hashedBody(entry) {
  const body = { schema_version: entry.schema_version };
  if (entry.hash_version !== 1) body.hash_version = entry.hash_version;
  Object.assign(body, {
    user_id: entry.user_id, seq: entry.seq, time: entry.time, session_id: entry.session_id,
    run_id: entry.run_id, actor: entry.actor, action: entry.action,
  });
  if (entry.hash_version >= DIGESTED_VERSION) body.payload_digest = entry.payload_digest;
  else body.payload = entry.payload;
  body.prev_hash = entry.prev_hash;
  return body;
}

function rfc8785(value, version) {
  let text;
  try {
    text = canonicalize(value);
  } catch (err) {
    // loomflow's words for it (canonical_bytes), so that both verifiers report one detail.
    if (/lone surrogate/i.test(err.message)) {
      throw new Error(`no canonical JSON (hash version ${version}): it holds a lone surrogate, which is not text`);
    }
    throw err;
  }
  if (typeof text !== 'string') throw new Error('no RFC 8785 form');
  return text;
}

// -- erasure records (loomflow's _ErasureRecord) -----------------------------------------------

// An entry whose payload is gone.
const erasedOf = (entry, position, rest) => ({
  seq: entry.seq, position, rest, time: entry.time, action: entry.action, hashVersion: entry.hash_version,
});

// What an audit.erasure entry says it erased, read the way loomflow's erasure wrote it: a
// forget or retention takes every hash version 3 entry before the record written before its
// "before" cut-off (all of them when null); a forget's console erasure only its "seqs". An
// entry of hash version 1 or 2 is taken only when "pre_v3" lists its digest; the payloads of
// erasure records and legal holds never; and nothing when a legal hold stood (erasure stops).
function erasureRecord(seq, payload, held) {
  const old = payload.pre_v3;
  const record = {
    seq, preV3: old && typeof old === 'object' && !Array.isArray(old) ? old : {},
    seqs: null, before: null, cutoffReadable: true, void: held,
  };
  if (Object.hasOwn(payload, 'seqs')) {
    const numbers = Array.isArray(payload.seqs) ? payload.seqs : [];
    record.seqs = new Set(numbers.filter((n) => Number.isInteger(n)));
  } else if (payload.before !== undefined && payload.before !== null) {
    try {
      checkTime(payload.before);
      record.before = payload.before; // exported times are fixed-width: text order is time order
    } catch {
      record.cutoffReadable = false;
    }
  }
  return record;
}

const sweeps = (record) => !record.void && record.seqs === null && record.cutoffReadable;
// Whether a sweeping record's cut-off reaches later than another's (null: everything).
const wider = (a, b) => (a.before === null || b.before === null
  ? a.before === null && b.before !== null : a.before > b.before);

function covers(record, gone) {
  if (record.void || gone.seq >= record.seq || KEPT_BY_ERASURE.includes(gone.action)) return false;
  if (record.seqs !== null && !record.seqs.has(gone.seq)) return false;
  if (gone.hashVersion < DIGESTED_VERSION) return Object.hasOwn(record.preV3, String(gone.seq));
  if (record.seqs !== null) return true;
  return record.cutoffReadable && (record.before === null || gone.time < record.before);
}

function seqList(seqs) {
  const ordered = [...seqs].sort((a, b) => a - b);
  if (!ordered.length) return 'no entries';
  const runs = [];
  for (const seq of ordered) {
    if (runs.length && seq === runs[runs.length - 1].at(-1) + 1) runs[runs.length - 1].push(seq);
    else runs.push([seq]);
  }
  let parts = runs.map((r) => (r.length === 1 ? `${r[0]}` : `${r[0]}-${r.at(-1)}`));
  if (parts.length > 6) parts = [...parts.slice(0, 5), `${parts.length - 5} more runs`];
  const text = parts.length === 1 ? parts[0] : `${parts.slice(0, -1).join(', ')} and ${parts.at(-1)}`;
  return `${ordered.length === 1 ? 'entry' : 'entries'} ${text}`;
}

function describe(record) {
  if (record.void) return `the one at seq ${record.seq} was written under a legal hold and erased nothing`;
  if (record.seqs !== null) return `the one at seq ${record.seq} erased ${seqList(record.seqs)} only`;
  if (!record.cutoffReadable) return `the one at seq ${record.seq} has a cut-off that is not a time`;
  if (record.before === null) return `the one at seq ${record.seq} erased every payload before it`;
  return `the one at seq ${record.seq} erased what was written before ${record.before}`;
}

function uncovered(gone, later) {
  if (KEPT_BY_ERASURE.includes(gone.action)) return `erasure keeps the payloads of ${gone.action} entries`;
  const more = later.length > 3 ? `; and ${later.length - 3} more` : '';
  return `${later.slice(0, 3).map(describe).join('; ')}${more} (entry ${gone.seq} was written at ${gone.time})`;
}

// -- one user's chain (loomflow's _ChainCheck) ------------------------------------------------

class ChainCheck {
  constructor(userId, heads) {
    this.userId = userId;
    this.expected = 1;
    this.prevHash = GENESIS;
    this.prevPosition = null;
    this.lastSeq = 0;
    this.lastHash = null;
    this.firstSeq = null;
    const pairs = new Map(heads.map((h) => [`${h.seq}\u0000${h.hash}`, [h.seq, h.hash]]));
    const order = (a, b) => a[0] - b[0] || (a[1] < b[1] ? -1 : a[1] > b[1] ? 1 : 0);
    this.saved = [...pairs.values()].sort(order);
    this.savedAt = new Set(this.saved.map(([seq]) => seq));
    this.erased = []; // erased payloads, waiting for an erasure record after them that covers them
    this.records = []; // the erasure records seen (see erasureRecord)
    this.held = false; // whether a legal hold stands at this point of the trail
    this.newest = null; // the highest hash version met so far in the trail, and where
  }

  problem(kind, seq, position, detail) {
    problem(this.userId, kind, seq, position, detail);
  }

  startAt(entry) {
    this.expected = entry.seq;
    this.prevHash = entry.prev_hash;
    this.lastSeq = entry.seq - 1;
  }

  // The entry at `seq` was exported unreadable (loomflow's _ChainCheck.skip): the entries
  // before it must still be there, and the chain goes on after it, its next link unchecked.
  skip(position, seq) {
    if (this.firstSeq === null) this.firstSeq = seq;
    if (seq <= this.lastSeq) return; // a second line claiming a seq: the unreadable report is enough
    if (seq > this.expected) this.gap(seq, position);
    this.expected = seq + 1;
    this.prevHash = null;
    this.prevPosition = position;
    this.lastSeq = seq;
    this.lastHash = null;
  }

  gap(seq, position) {
    const gap = `${span(this.expected, seq - 1)} ${seq - 1 === this.expected ? 'is' : 'are'}`;
    this.problem('missing', this.expected, position, `${gap} missing before entry ${seq}: deleted`);
  }

  feed(position, entry) {
    const seq = entry.seq;
    if (this.firstSeq === null) this.firstSeq = seq;
    const why = this.content(entry, position);
    if (why !== null) {
      this.problem('edited', seq, position, `entry ${seq} was changed: ${why}`);
    } else if (entry.action === AUDIT_ERASURE && entry.payload !== null) {
      this.records.push(erasureRecord(seq, entry.payload, this.held));
    }
    if (HOLD_ACTIONS.includes(entry.action)) this.held = entry.action === HOLD_PLACED;
    if (this.newest === null || entry.hash_version >= this.newest.version) {
      this.newest = { version: entry.hash_version, seq };
    }
    if (this.savedAt.has(seq)) {
      for (const [savedSeq, savedHash] of this.saved) {
        if (savedSeq === seq && savedHash !== entry.hash) {
          this.problem('head_mismatch', seq, position,
            `entry ${seq} is not the entry a saved head recorded at seq ${seq}: the trail was rewritten`);
        }
      }
    }
    if (seq <= this.lastSeq) {
      this.problem('duplicate', seq, position, `a second entry claims seq ${seq}`);
      return;
    }
    if (seq > this.expected) {
      this.gap(seq, position);
    } else if (this.prevHash !== null && entry.prev_hash !== this.prevHash) {
      this.problem('broken_link', seq > 1 ? seq - 1 : seq, position,
        `entry ${seq} does not link to entry ${seq - 1}: entry ${seq - 1} was replaced or rewritten`);
    }
    if (this.prevPosition !== null && position < this.prevPosition) {
      this.problem('reordered', seq, position,
        `entry ${seq} is stored at ${position}, before entry ${this.lastSeq} ` +
        `(at ${this.prevPosition}): the trail was reordered`);
    }
    this.expected = seq + 1;
    this.prevHash = entry.hash;
    this.prevPosition = position;
    this.lastSeq = seq;
    this.lastHash = entry.hash;
  }

  // Why the entry's content does not match its hash (null: it does); notes an erased payload.
  content(entry, position) {
    const version = entry.hash_version;
    if (entry.schema_version !== ENTRY_SCHEMA_VERSION) {
      // Hashed whole or not, its fields may mean what this verifier cannot tell.
      return `its layout is schema version ${entry.schemaText}, which this loomflow ` +
        `does not know (it reads version ${ENTRY_SCHEMA_VERSION})`;
    }
    if (entry.payload === null) {
      report.erased += 1;
      if (version < DIGESTED_VERSION) {
        // Its hash covered the payload: an erasure record's digest of the rest vouches instead.
        const { payload: _gone, ...rest } = hashedBody(entry);
        let digest;
        try { digest = sha256(rfc8785(rest, DIGESTED_VERSION)); } catch { digest = 'unhashable'; }
        this.erased.push(erasedOf(entry, position, digest));
        return null;
      }
      this.erased.push(erasedOf(entry, position, null));
    }
    if (version === 1) {
      // Python's own spelling: only loomflow's verifier can rebuild it.
      version1 += 1;
      const newer = this.newest !== null && this.newest.version > 1 ? this.newest : null;
      if (newer !== null) {
        // loomflow writes version 1 no more, so a later entry of it was most likely relabelled
        // (its payload edited, its hash kept): that would pass here unseen, whatever the flags.
        problem(this.userId, 'version_1', entry.seq, position,
          `entry ${entry.seq} is hash version 1 after entry ${newer.seq} of hash version ` +
          `${newer.version}: it may have been relabelled so that its content goes unchecked ` +
          'here; check the export with `loomflow audit verify --file`');
      } else if (requireV2) {
        problem(this.userId, 'version_1', entry.seq, position,
          `entry ${entry.seq} is hash version 1: its content cannot be checked here`);
      }
      return null;
    }
    if (version !== 2 && version !== 3) {
      return `its content cannot be hashed (unknown audit hash version ${entry.versionText}: ` +
        'this loomflow checks versions 1, 2, 3)';
    }
    rehashed += 1;
    const hashed = hashedBody(entry);
    const unsafeHashed = firstUnsafeInteger(entry.unsafe, Object.keys(hashed));
    if (unsafeHashed !== undefined) {
      return `its content cannot be hashed (${noCanonicalForm(version, unsafeHashed)})`;
    }
    try {
      if (sha256(rfc8785(hashed, version)) !== entry.hash) return 'it no longer matches its hash';
    } catch (err) {
      return `its content cannot be hashed (${err.message})`;
    }
    if (version < DIGESTED_VERSION || entry.payload === null) return null;
    if (!isText(entry.payload_salt) || !isText(entry.payload_digest)) {
      return 'its payload has no salt or digest';
    }
    const unsafePayload = firstUnsafeInteger(entry.unsafe, ['payload']);
    if (unsafePayload !== undefined) {
      return `its payload cannot be hashed (${noCanonicalForm(version, unsafePayload)})`;
    }
    try {
      const digest = sha256(rfc8785({ payload: entry.payload, salt: entry.payload_salt }, version));
      return digest === entry.payload_digest ? null : 'its payload no longer matches its digest';
    } catch (err) {
      return `its payload cannot be hashed (${err.message})`;
    }
  }

  finishErasures() {
    if (!this.erased.length) return;
    // covers() decides; these indexes only pick the records that could (see loomflow's
    // _ChainCheck.finish_erasures): the widest cut-off from each record on, and who lists a seq.
    const records = [...this.records].sort((a, b) => a.seq - b.seq);
    const widest = new Array(records.length + 1).fill(null);
    for (let i = records.length - 1; i >= 0; i -= 1) {
      const record = records[i];
      const best = widest[i + 1];
      widest[i] = sweeps(record) && (best === null || wider(record, best)) ? record : best;
    }
    const naming = new Map();
    for (const record of records) {
      const listed = new Set(Object.keys(record.preV3).filter((k) => /^[0-9]+$/.test(k)).map(Number));
      for (const named of record.seqs ?? []) listed.add(named);
      for (const named of listed) {
        if (!naming.has(named)) naming.set(named, []);
        naming.get(named).push(record);
      }
    }
    for (const gone of this.erased) {
      const { seq, position, rest } = gone;
      let [low, high] = [0, records.length]; // the first record after the entry
      while (low < high) {
        const mid = (low + high) >> 1;
        if (records[mid].seq > seq) high = mid;
        else low = mid + 1;
      }
      const candidates = (naming.get(seq) ?? []).filter((r) => r.seq > seq);
      if (widest[low] !== null) candidates.push(widest[low]);
      const covering = candidates.filter((r) => covers(r, gone));
      if (low === records.length) {
        this.problem('erased', seq, position,
          `the payload of entry ${seq} is gone, but no erasure record follows it`);
      } else if (!covering.length) {
        this.problem('erased', seq, position, rest !== null
          ? `the payload of entry ${seq} (hash version 1 or 2) is gone, but no erasure record ` +
            'vouches for its other fields'
          : `the payload of entry ${seq} is gone, but no erasure record covers it: ${uncovered(gone, records.slice(low))}`);
      } else if (rest !== null && !covering.some((r) => r.preV3[String(seq)] === rest)) {
        this.problem('edited', seq, position, `entry ${seq} was changed after its payload was erased`);
      }
    }
  }

  finishSaved() {
    if (!this.saved.length) return;
    const furthest = this.saved[this.saved.length - 1][0];
    if (furthest > this.lastSeq) {
      const gap = `${span(this.lastSeq + 1, furthest)} ${furthest === this.lastSeq + 1 ? 'is' : 'are'}`;
      this.problem('truncated', this.lastSeq + 1, null,
        `${gap} missing at the end: a saved head records seq ${furthest}`);
    }
    const earliest = this.saved[0][0];
    if (this.firstSeq !== null && earliest < this.firstSeq) {
      warning(this.userId, 'unanchored', earliest, null,
        `a saved head records seq ${earliest}, before the first entry checked ` +
        `(${this.firstSeq}): it cannot be compared here`);
    }
  }
}

// -- the export, line by line ----------------------------------------------------------------

// --user is an id as loomflow takes one (verify --file refuses others): an empty id, or one
// with a control character, names no trail, and every line would be outside the export.
if (typeof onlyUser === 'string') {
  try {
    checkId('--user', onlyUser, MAX_ID_BYTES);
  } catch (err) {
    console.error(`${err.message}\n${usage}`);
    process.exit(2);
  }
}

let fd;
try {
  fd = openSync(exportPath, 'r');
} catch (err) {
  console.error(`cannot read ${exportPath}: ${err.message}`);
  process.exit(2);
}
const trails = new Map(); // user key -> [{seq, number, entry}], users in the order first seen
const outside = new Map(); // user key -> {number, entry, reasons, more}, by first such line
let headerAt = null; // the header's line number
let number = 0;
let first = true;
// Read byte for byte (latin1) and decoded line by line: a 'utf8' stream would put U+FFFD in
// place of a byte that is not UTF-8, and the line would then be checked as an edited entry;
// loomflow reports such a line as unreadable, where it is.
const input = createReadStream(null, { fd, encoding: 'latin1' });
const utf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });
// readline splits at \n and \r only; loomflow writes U+2028 and U+2029 escaped anyway.
try {
  for await (const bytes of createInterface({ input, crlfDelay: Infinity })) {
    number += 1;
    let line;
    try {
      line = utf8.decode(Buffer.from(bytes, 'latin1'));
    } catch {
      first = false;
      problem(null, 'unreadable', null, number, 'not an audit entry: the line is not UTF-8 text');
      continue;
    }
    if (BLANK.test(line)) continue;
    if (first) {
      first = false;
      try {
        exportFilters = readHeader(line);
      } catch (err) {
        problem(null, 'unreadable', null, number, `not an export header this verifier reads: ${err.message}`);
        continue;
      }
      if (exportFilters !== null) {
        headerAt = number;
        continue;
      }
    }
    let entry;
    try {
      entry = readEntry(line);
    } catch (err) {
      problem(null, 'unreadable', null, number, `not an audit entry: ${err.message}`.slice(0, 320));
      continue;
    }
    const key = keyOf(entry.user_id);
    const reasons = outsideReasons(entry, key);
    if (reasons.length) {
      if (outside.has(key)) outside.get(key).more += 1;
      else outside.set(key, { number, entry, reasons, more: 0 });
    }
    if (onlyKey !== undefined && key !== onlyKey) continue;
    if (!trails.has(key)) trails.set(key, []);
    trails.get(key).push({ seq: entry.seq, number, entry });
  }
} catch (err) {
  console.error(`cannot read ${exportPath}: ${err.message}`);
  process.exit(2);
}

// Each user's entries in seq order, with their line numbers as positions, as loomflow checks
// a store's rows: a line moved elsewhere is "reordered", not a deletion plus a duplicate.
const checks = new Map();
// Entries are never deleted, so an export whose header names no filter that starts a trail
// later holds each trail from entry 1: one starting later lost its first lines.
const fromStart = exportFilters !== null &&
  Object.keys(exportFilters).every((name) => name === 'user_id' || name === 'until');
for (const [key, trail] of trails) {
  trail.sort((a, b) => a.seq - b.seq || a.number - b.number);
  for (const { number: line, entry } of trail) {
    let check = checks.get(key);
    if (check === undefined) {
      check = new ChainCheck(entry.user_id, saved.get(key) ?? []);
      checks.set(key, check);
      report.users += 1;
      if (entry.seq > 1 && fromStart) {
        check.startAt(entry);
        const gap = entry.seq === 2 ? 'entry 1 is' : `entries 1-${entry.seq - 1} are`;
        problem(entry.user_id, 'missing', 1, line,
          `${gap} missing before entry ${entry.seq}: the export's header names no since, ` +
          'session, run or action, so it holds the trail from its start');
      } else if (entry.seq > 1) {
        check.startAt(entry);
        warning(entry.user_id, 'unanchored', entry.seq, line,
          `the export starts at entry ${entry.seq}: its link to entry ${entry.seq - 1} cannot be checked here`);
      }
    }
    if (entry.unreadable !== undefined) {
      // As loomflow's "\u" escapes spell it (json.dumps): ASCII, whatever the line holds.
      const why = JSON.stringify(entry.unreadable)
        .replace(/[\u0080-\uffff]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
      problem(entry.user_id, 'unreadable', entry.seq, line,
        `entry ${entry.seq} was exported unreadable: ${why.slice(0, 300)}`);
      check.skip(line, entry.seq);
      continue;
    }
    report.entries += 1;
    check.feed(line, entry);
  }
}

// Every user with a saved head is looked for (with --user, the saved heads are that user's):
// which users the export covers is never what its header says.
for (const [key, heads] of saved) {
  const found = checks.get(key);
  const last = heads.reduce((a, b) => (b.seq > a.seq ? b : a));
  report.heads.push(...heads);
  if (found === undefined) {
    problem(last.user_id, 'truncated', 1, null,
      `the export holds none of this user's entries, though a saved head records seq ${last.seq}`);
    continue;
  }
  found.finishSaved();
  if (found.lastSeq > last.seq) {
    const one = last.seq + 1 === found.lastSeq;
    warning(found.userId, 'unanchored', last.seq + 1, null,
      `${span(last.seq + 1, found.lastSeq)} ${one ? 'comes' : 'come'} after the last saved head ` +
      `(seq ${last.seq}): a later saved head would cover ${one ? 'it' : 'them'}`);
  }
}
for (const [key, check] of checks) {
  if (headsGiven && !saved.has(key) && check.firstSeq !== null) {
    // Heads of another log, or with this user's cut out: nothing vouches for the trail.
    warning(check.userId, 'unanchored', check.firstSeq, null,
      `${span(check.firstSeq, check.lastSeq)}: no saved head covers this user's trail`);
  }
}
for (const check of checks.values()) check.finishErasures();
for (const { number: line, entry, reasons, more } of outside.values()) {
  const also = more ? ` (as ${more === 1 ? 'is' : 'are'} ${more} more line${more === 1 ? '' : 's'} of this user)` : '';
  problem(entry.user_id, 'outside_export', entry.seq, line,
    `entry ${entry.seq} is outside the export: ${reasons.join('; ')}${also}`);
}
if (onlyKey === undefined && exportFilters !== null && Object.hasOwn(exportFilters, 'user_id')) {
  const named = exportFilters.user_id;
  warning(named, 'unscoped', null, headerAt,
    `the export says it holds only ${trailOf(named)}, but without ${named === null ? '--anonymous' : '--user'} ` +
    `it is checked as the whole log: pass ${optionFor(named)} to check it alone`);
}

const ok = report.problems.length === 0;
if (asJson) {
  console.log(JSON.stringify({ ok, ...report, ...(exportFilters === null ? {} : { export_filters: exportFilters }) }));
} else {
  const show = (label, p) => {
    const where = p.position === null ? '' : `line ${p.position}: `;
    const who = p.kind === 'unreadable' && p.seq === null ? '?' : JSON.stringify(p.user_id);
    console.log(`${label}  ${where}user ${who}: ${p.kind}: ${p.detail}`);
  };
  for (const p of report.problems) show('problem', p);
  for (const w of report.warnings) show('warning', w);
  if (exportFilters !== null && Object.keys(exportFilters).length) {
    // What the exporter wrote; no hash covers it, so it narrowed nothing (see "unscoped").
    const named = Object.entries(exportFilters).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(', ');
    console.log(`note     the export says it was made with ${named}`);
  }
  const v1 = version1
    ? `; ${version1} hash version 1 entries linked but not re-hashed (only loomflow's Python verifier can)`
    : '';
  console.log(
    `${ok ? 'ok' : 'FAILED'}: ${report.entries} entries of ${report.users} users, ` +
      `${rehashed} re-hashed (RFC 8785)${v1}, ${report.erased ? `${report.erased} payloads erased, ` : ''}` +
      `${new Set(report.heads.map((h) => keyOf(h.user_id))).size} users' saved heads, ` +
      `${report.problems.length} problems`,
  );
}
process.exit(ok ? 0 : 1);
