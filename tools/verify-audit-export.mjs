#!/usr/bin/env node
// Re-checks a loomflow audit export without Python: every hash version 2 entry's SHA-256 over
// its RFC 8785 form, and each user's seq (from 1, no gaps) and prev_hash links; with a heads
// file (the output of `loomflow audit verify --json`), also that the export reaches each saved
// head and holds that very entry. See docs/audit.md, "Checking an export in another language".
//
//   npm ci --prefix tools && node tools/verify-audit-export.mjs EXPORT.jsonl [HEADS.json]
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

  if (entry.hash_version === 2) {
    let why = 'it no longer matches its hash';
    try {
      if (createHash('sha256').update(canonicalize(body), 'utf8').digest('hex') === hash) why = null;
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

  let chain = chains.get(user);
  if (chain === undefined) {
    chain = { next: 1, prev: GENESIS, last: 0, seen: new Map() };
    chains.set(user, chain);
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

for (const text of problems) console.log(`problem  ${text}`);
for (const text of notes) console.log(`note     ${text}`);
const v1 = version1
  ? `; ${version1} hash version 1 entries linked but not re-hashed (only loomflow's Python verifier can)`
  : '';
console.log(
  `${problems.length ? 'FAILED' : 'ok'}: ${entries} entries of ${chains.size} users, ` +
    `${rehashed} re-hashed (RFC 8785)${v1}, ${saved.size} users' saved heads, ` +
    `${problems.length} problems`,
);
process.exit(problems.length ? 1 : 0);
