#!/usr/bin/env node
// Re-checks a loomflow audit export without Python: every hash version 2 entry's SHA-256 over
// its RFC 8785 form, and each user's seq (from 1, no gaps) and prev_hash links; with a heads
// file (the output of `loomflow audit verify --json`), also that the export reaches each saved
// head and holds that very entry. See docs/audit.md, "Checking an export in another language".
//
//   npm ci --prefix tools && node tools/verify-audit-export.mjs EXPORT.jsonl [HEADS.json]
//
// Hash version 3 entries hash a salted digest of their payload instead of the payload, so a
// payload may be erased ("payload": null) without breaking the chain; an erased payload must be
// followed by an audit.erasure entry of the same user, which for an erased version 1 or 2
// entry also keeps the digest of its other fields.
//
// Exit status: 0 intact, 1 a problem found, 2 bad usage or an unreadable file.
// Version 1 entries (written before loomflow 0.21) hash Python's own JSON spelling, which
// JavaScript cannot rebuild from parsed values (5.0 and 5 both parse to 5): their links are
// checked, their content is not, and the summary counts them. --require-v2 makes them fail.

import { createHash } from 'node:crypto';
import { createReadStream, openSync, readFileSync } from 'node:fs';
import { createInterface } from 'node:readline';
import canonicalize from 'canonicalize';

const GENESIS = '0'.repeat(64);
const args = process.argv.slice(2);
const requireV2 = args.includes('--require-v2');
const [exportPath, headsPath] = args.filter((a) => a !== '--require-v2');
if (!exportPath) {
  console.error('usage: verify-audit-export.mjs [--require-v2] EXPORT.jsonl [HEADS.json]');
  process.exit(2);
}

const problems = [];
const notes = [];
const say = (list, line, user, text) =>
  list.push(`${line === null ? '' : `line ${line}: `}user ${user}: ${text}`);

// Saved heads: user key -> [{seq, hash}]; the entries they name are remembered while reading.
const saved = new Map();
if (headsPath) {
  try {
    const data = JSON.parse(readFileSync(headsPath, 'utf8'));
    for (const head of Array.isArray(data) ? data : data.heads ?? []) {
      if (!Number.isSafeInteger(head?.seq) || typeof head.hash !== 'string') {
        throw new Error(`not a chain head: ${JSON.stringify(head)}`);
      }
      const key = JSON.stringify(head.user_id ?? null);
      saved.set(key, [...(saved.get(key) ?? []), head]);
    }
  } catch (err) {
    console.error(`cannot read the heads ${headsPath}: ${err.message}`);
    process.exit(2);
  }
}

const chains = new Map(); // user key -> {next, prev, last, seen: Map(seq -> hash) of saved seqs}
let entries = 0;
let rehashed = 0;
let version1 = 0;
let erased = 0;
const sha256 = (text) => createHash('sha256').update(text, 'utf8').digest('hex');
let number = 0;
let fd;
try {
  fd = openSync(exportPath, 'r');
} catch (err) {
  console.error(`cannot read ${exportPath}: ${err.message}`);
  process.exit(2);
}
const input = createReadStream(null, { fd, encoding: 'utf8' });
// readline splits at \n and \r only; loomflow writes U+2028 and U+2029 escaped anyway.
for await (const line of createInterface({ input, crlfDelay: Infinity })) {
  number += 1;
  if (!line.trim()) continue;
  let entry;
  try {
    entry = JSON.parse(line);
  } catch (err) {
    say(problems, number, '?', `not JSON (${err.message})`);
    continue;
  }
  const { hash, ...body } = entry ?? {};
  if (
    typeof entry !== 'object' || entry === null || Array.isArray(entry) ||
    !Number.isSafeInteger(entry.seq) || entry.seq < 1 ||
    typeof hash !== 'string' || typeof entry.prev_hash !== 'string'
  ) {
    say(problems, number, '?', 'not an audit entry');
    continue;
  }
  entries += 1;
  const user = JSON.stringify(entry.user_id ?? null);
  const seq = entry.seq;

  const user0 = JSON.stringify(entry.user_id ?? null);
  let chain0 = chains.get(user0);
  if (chain0 === undefined) {
    chain0 = { next: 1, prev: GENESIS, last: 0, seen: new Map(), erased: [], records: [] };
    chains.set(user0, chain0);
    chain0.fresh = true;
  }
  const erasedPayload = entry.payload === null;
  if (erasedPayload) {
    erased += 1;
    if (entry.hash_version !== 3) {
      // Its hash covered the payload: an erasure record's digest of the rest vouches instead.
      const { payload: _gone, ...rest } = body;
      let digest = null;
      try { digest = sha256(canonicalize(rest)); } catch { digest = 'unhashable'; }
      chain0.erased.push({ seq: entry.seq, line: number, rest: digest });
      if (entry.hash_version === undefined || entry.hash_version === 1) version1 += 1;
    } else {
      chain0.erased.push({ seq: entry.seq, line: number, rest: null });
    }
  }
  if (entry.hash_version === 3) {
    const { payload, payload_salt: salt, ...hashed } = body;
    let why = 'it no longer matches its hash';
    try {
      if (sha256(canonicalize(hashed)) === hash) why = null;
      if (!why && payload !== null) {
        if (typeof salt !== 'string' || typeof entry.payload_digest !== 'string') {
          why = 'its payload has no salt or digest';
        } else if (sha256(canonicalize({ payload, salt })) !== entry.payload_digest) {
          why = 'its payload no longer matches its digest';
        }
      }
    } catch (err) {
      why = `it has no RFC 8785 form (${err.message})`;
    }
    rehashed += 1;
    if (why) say(problems, number, user, `entry ${seq} was changed: ${why}`);
    else if (entry.action === 'audit.erasure' && payload !== null && typeof payload === 'object') {
      const old = payload.pre_v3;
      chain0.records.push({ seq, old: old && typeof old === 'object' ? old : {} });
    }
  } else if (erasedPayload) {
    // checked against the erasure records at the end
  } else if (entry.hash_version === 2) {
    let why = 'it no longer matches its hash';
    try {
      if (sha256(canonicalize(body)) === hash) why = null;
    } catch (err) {
      why = `it has no RFC 8785 form (${err.message})`;
    }
    rehashed += 1;
    if (why) say(problems, number, user, `entry ${seq} was changed: ${why}`);
  } else if (entry.hash_version === undefined || entry.hash_version === 1) {
    version1 += 1;
    if (requireV2) say(problems, number, user, `entry ${seq} is hash version 1: not checkable here`);
  } else {
    say(problems, number, user, `entry ${seq} has an unknown hash_version ${JSON.stringify(entry.hash_version)}`);
  }

  const chain = chains.get(user);
  if (chain.fresh) {
    chain.fresh = false;
    if (seq > 1) {
      // An export from a date on: its first link points before the file.
      chain.next = seq;
      chain.prev = entry.prev_hash;
      chain.last = seq - 1;
      say(notes, number, user, `starts at entry ${seq}: its link to entry ${seq - 1} is not checked`);
    }
  }
  if (seq <= chain.last) {
    say(problems, number, user, `a second entry claims seq ${seq}`);
    continue;
  }
  if (seq > chain.next) {
    say(problems, number, user, `entries ${chain.next}-${seq - 1} are missing before entry ${seq}`);
  } else if (entry.prev_hash !== chain.prev) {
    say(problems, number, user, `entry ${seq} does not link to entry ${seq - 1}`);
  }
  if ((saved.get(user) ?? []).some((h) => h.seq === seq)) chain.seen.set(seq, hash);
  chain.next = seq + 1;
  chain.prev = hash;
  chain.last = seq;
}

for (const [user, heads] of saved) {
  const chain = chains.get(user);
  for (const head of heads) {
    if (chain === undefined || head.seq > chain.last) {
      say(problems, null, user, `the export ends before the saved head at seq ${head.seq}: truncated`);
    } else if (chain.seen.has(head.seq) && chain.seen.get(head.seq) !== head.hash) {
      say(problems, null, user, `entry ${head.seq} is not the one a saved head names: rewritten`);
    } else if (!chain.seen.has(head.seq)) {
      say(notes, null, user, `the saved head at seq ${head.seq} comes before the export starts`);
    }
  }
}

for (const [user, chain] of chains) {
  for (const gone of chain.erased) {
    const later = chain.records.filter((r) => r.seq > gone.seq).map((r) => r.old);
    if (!later.length) {
      say(problems, gone.line, user, `the payload of entry ${gone.seq} is gone, but no erasure record follows it`);
    } else if (gone.rest !== null && !later.some((old) => old[String(gone.seq)] === gone.rest)) {
      say(problems, gone.line, user, later.some((old) => String(gone.seq) in old)
        ? `entry ${gone.seq} was changed after its payload was erased`
        : `the payload of entry ${gone.seq} is gone, but no erasure record vouches for its other fields`);
    }
  }
}

for (const text of problems) console.log(`problem  ${text}`);
for (const text of notes) console.log(`note     ${text}`);
const v1 = version1
  ? `; ${version1} hash version 1 entries linked but not re-hashed (only loomflow's Python verifier can)`
  : '';
console.log(
  `${problems.length ? 'FAILED' : 'ok'}: ${entries} entries of ${chains.size} users, ` +
    `${rehashed} re-hashed (RFC 8785)${v1}, ${erased ? `${erased} payloads erased, ` : ''}` +
    `${saved.size} users' saved heads, ` +
    `${problems.length} problems`,
);
process.exit(problems.length ? 1 : 0);
