"""The Lua scripts of the Redis quota ledger (gateway/quotas/redis_ledger.py).

Redis runs a script as one command: nothing else runs between its reads and writes, so each
check-and-update is atomic across every replica. Times are the Redis server's clock (TIME, in
ms), so replicas' clocks do not matter. ARGV[1] is the key prefix; the keys, per tenant T:

  P:t:T:rq    ZSET  hold -> admission ms          admissions in the 60 s window
  P:t:T:tk    ZSET  hold -> admission ms          token entries in the window
  P:t:T:tv    HASH  hold -> tokens                reserved, then used once settled
  P:t:T:tw    STR   sum of tv over the window
  P:t:T:live  STR   holds queued or running       P:t:T:queued  STR  holds queued
  P:d:T:DAY:used / :resv  STR  the UTC day's used tokens (seeded from the database) / reserved
  P:holds:R   HASH  hold -> {t, n, d, s, r}       replica R's holds (tenant, need, day, q|r, day reserved)
  P:replicas  ZSET  R -> lease deadline ms        a replica past its deadline is swept
  P:slots:R   HASH  slot -> 'C:W'                 replica R's worker slots (class, worker)
  P:ws:W      HASH  class -> jobs                 jobs sent to worker W and not started, all replicas
  P:vtc:L     HASH  tenant -> counter             the fair scheduler's counters of lane L, all replicas
  P:vb:R      HASH  lane -> JSON list             tenants backlogged on replica R (expires with its lease)

The keys a script touches are derived from its arguments and the hold records, so the ledger
needs one Redis (standalone or Sentinel-managed), not Redis Cluster.
"""

from __future__ import annotations

_COMMON = r"""
local P = ARGV[1]
local WINDOW = 60000
local DAY_TTL = 172800
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function tkey(tenant, name) return P .. ':t:' .. tenant .. ':' .. name end
local function dkey(tenant, day, name) return P .. ':d:' .. tenant .. ':' .. day .. ':' .. name end
local function num(v) return tonumber(v) or 0 end

local function expire(tenant, now)
  local horizon = now - WINDOW
  redis.call('ZREMRANGEBYSCORE', tkey(tenant, 'rq'), '-inf', horizon)
  local old = redis.call('ZRANGEBYSCORE', tkey(tenant, 'tk'), '-inf', horizon)
  if #old == 0 then return end
  local freed = 0
  for _, hold in ipairs(old) do
    freed = freed + num(redis.call('HGET', tkey(tenant, 'tv'), hold))
    redis.call('HDEL', tkey(tenant, 'tv'), hold)
  end
  redis.call('DECRBY', tkey(tenant, 'tw'), freed)
  redis.call('ZREMRANGEBYSCORE', tkey(tenant, 'tk'), '-inf', horizon)
end

local function view(tenant, now)
  local rq = redis.call('ZRANGE', tkey(tenant, 'rq'), 0, 0, 'WITHSCORES')
  local tk = redis.call('ZRANGE', tkey(tenant, 'tk'), 0, 0, 'WITHSCORES')
  local rreset, treset = 0, 0
  if #rq > 0 then rreset = tonumber(rq[2]) + WINDOW - now end
  if #tk > 0 then treset = tonumber(tk[2]) + WINDOW - now end
  -- seq orders the views: replies of concurrent scripts reach a replica in any order
  local seq = redis.call('INCR', tkey(tenant, 'seq'))
  redis.call('PEXPIRE', tkey(tenant, 'seq'), 86400000)
  return {redis.call('ZCARD', tkey(tenant, 'rq')), rreset, num(redis.call('GET', tkey(tenant, 'tw'))), treset, seq}
end

-- Ends a hold: `rec` is its record, or nil when it is gone already (its replica was swept), in
-- which case only the real usage is charged.
local function end_hold(tenant, day, hold, used, rec)
  if rec then
    redis.call('DECR', tkey(tenant, 'live'))
    if rec.s == 'q' then redis.call('DECR', tkey(tenant, 'queued')) end
    if rec.r == 1 then redis.call('DECRBY', dkey(tenant, day, 'resv'), rec.n) end
  end
  if used > 0 and redis.call('EXISTS', dkey(tenant, day, 'used')) == 1 then
    redis.call('INCRBY', dkey(tenant, day, 'used'), used)
  end
  local old = redis.call('HGET', tkey(tenant, 'tv'), hold)
  if old then  -- still inside the minute window: the entry now counts what was used
    redis.call('HSET', tkey(tenant, 'tv'), hold, used)
    redis.call('INCRBY', tkey(tenant, 'tw'), used - tonumber(old))
  end
end

-- Worker slots (gateway/dispatch/slots.py; TAKE_SLOT below): replica R's record of slot J is
-- P:slots:R[J] = 'C:W' (class digit, worker id); P:ws:W[C] counts them over every replica.
local function slot_uncount(rec)
  local counts, class = P .. ':ws:' .. string.sub(rec, 3), string.sub(rec, 1, 1)
  if redis.call('HINCRBY', counts, class, -1) <= 0 then redis.call('HDEL', counts, class) end
end

local function slot_release(replica, slot)
  local key = P .. ':slots:' .. replica
  local rec = redis.call('HGET', key, slot)
  if not rec then return 0 end
  redis.call('HDEL', key, slot)
  slot_uncount(rec)
  return 1
end

local function slot_release_all(replica)
  local key = P .. ':slots:' .. replica
  local all = redis.call('HGETALL', key)
  for i = 2, #all, 2 do slot_uncount(all[i]) end
  redis.call('DEL', key)
end

-- Releases every hold and worker slot of every replica whose lease deadline has passed.
local function sweep(now)
  local dead = redis.call('ZRANGEBYSCORE', P .. ':replicas', '-inf', now)
  for _, replica in ipairs(dead) do
    local key = P .. ':holds:' .. replica
    local all = redis.call('HGETALL', key)
    for i = 1, #all, 2 do
      local rec = cjson.decode(all[i + 1])
      end_hold(rec.t, rec.d, all[i], 0, rec)
    end
    redis.call('DEL', key)
    slot_release_all(replica)
    redis.call('ZREM', P .. ':replicas', replica)
  end
end
"""

# ARGV: prefix, replica, hold, lease ms, tenant, need, day, then the limits max_concurrent,
# max_queued, requests_per_minute, tokens_per_minute, tokens_per_day ('' = none).
# Returns {status, detail, requests, requests reset ms, tokens, tokens reset ms}; status is ok,
# unseeded, concurrent, queued, requests (detail: wait ms), tokens (wait ms) or day (tokens left).
ADMIT = _COMMON + r"""
local replica, hold, lease = ARGV[2], ARGV[3], tonumber(ARGV[4])
local tenant, need, day = ARGV[5], tonumber(ARGV[6]), ARGV[7]
local mc, mq, rpm, tpm, tpd = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]),
  tonumber(ARGV[11]), tonumber(ARGV[12])
local now = now_ms()
redis.call('ZADD', P .. ':replicas', now + lease, replica)
sweep(now)
expire(tenant, now)
local function answer(status, detail)
  local v = view(tenant, now)
  return {status, detail, v[1], v[2], v[3], v[4], v[5]}
end
local seeded = redis.call('EXISTS', dkey(tenant, day, 'used')) == 1
if tpd and not seeded then return answer('unseeded', 0) end
if mc and num(redis.call('GET', tkey(tenant, 'live'))) >= mc then return answer('concurrent', 0) end
if mq and num(redis.call('GET', tkey(tenant, 'queued'))) >= mq then return answer('queued', 0) end
if rpm and redis.call('ZCARD', tkey(tenant, 'rq')) >= rpm then
  local first = redis.call('ZRANGE', tkey(tenant, 'rq'), 0, 0, 'WITHSCORES')
  return answer('requests', tonumber(first[2]) + WINDOW - now)
end
local in_window = num(redis.call('GET', tkey(tenant, 'tw')))
if tpm and in_window + need > tpm then
  local entries = redis.call('ZRANGE', tkey(tenant, 'tk'), 0, -1, 'WITHSCORES')
  local freed, wait = 0, WINDOW
  for i = 1, #entries, 2 do
    freed = freed + num(redis.call('HGET', tkey(tenant, 'tv'), entries[i]))
    if in_window - freed + need <= tpm then
      wait = tonumber(entries[i + 1]) + WINDOW - now
      break
    end
  end
  return answer('tokens', wait)
end
if tpd then
  local used = num(redis.call('GET', dkey(tenant, day, 'used')))
  local left = tpd - used - num(redis.call('GET', dkey(tenant, day, 'resv')))
  if need > left then return answer('day', math.max(0, left)) end
end
for _, name in ipairs({'rq', 'tk'}) do redis.call('ZADD', tkey(tenant, name), now, hold) end
redis.call('HSET', tkey(tenant, 'tv'), hold, need)
redis.call('INCRBY', tkey(tenant, 'tw'), need)
for _, name in ipairs({'rq', 'tk', 'tv', 'tw'}) do redis.call('PEXPIRE', tkey(tenant, name), WINDOW + 1000) end
local reserved = 0
if seeded then
  redis.call('INCRBY', dkey(tenant, day, 'resv'), need)
  redis.call('EXPIRE', dkey(tenant, day, 'resv'), DAY_TTL)
  reserved = 1
end
redis.call('INCR', tkey(tenant, 'live'))
redis.call('INCR', tkey(tenant, 'queued'))
local rec = {t = tenant, n = need, d = day, s = 'q', r = reserved}
redis.call('HSET', P .. ':holds:' .. replica, hold, cjson.encode(rec))
return answer('ok', 0)
"""

# ARGV: prefix, tenant, day, used tokens. The first writer wins.
SEED_DAY = _COMMON + r"""
redis.call('SET', dkey(ARGV[2], ARGV[3], 'used'), ARGV[4], 'NX', 'EX', DAY_TTL)
return 0
"""

# ARGV: prefix, replica, hold.
MARK_RUNNING = _COMMON + r"""
local key = P .. ':holds:' .. ARGV[2]
local raw = redis.call('HGET', key, ARGV[3])
if raw then
  local rec = cjson.decode(raw)
  if rec.s == 'q' then
    rec.s = 'r'
    redis.call('DECR', tkey(rec.t, 'queued'))
    redis.call('HSET', key, ARGV[3], cjson.encode(rec))
  end
end
return 0
"""

# ARGV: prefix, replica, hold, tenant, day, used tokens. Returns the tenant's view (as ADMIT's last five).
FINISH = _COMMON + r"""
local key, hold, tenant, day = P .. ':holds:' .. ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local now = now_ms()
expire(tenant, now)
local raw = redis.call('HGET', key, hold)
local rec = nil
if raw then
  rec = cjson.decode(raw)
  redis.call('HDEL', key, hold)
end
end_hold(tenant, day, hold, tonumber(ARGV[6]), rec)
return view(tenant, now)
"""

# ARGV: prefix, replica, lease ms. Renews the replica's lease (0: gives it up, so its holds are
# released now) and sweeps every replica whose lease has run out.
REFRESH = _COMMON + r"""
local now = now_ms()
redis.call('ZADD', P .. ':replicas', now + tonumber(ARGV[3]), ARGV[2])
sweep(now)
return 0
"""


# ---- the global schedule (gateway/dispatch/slots.py) ------------------------------------------------------

# ARGV: prefix, replica, lease ms, slot (the job's id and a take number), class, max_waiting,
# by_class ('1': the room rule with overtaking; '0': the plain bound), model, the job's fair-share
# counter (its tenant's virtual tokens in its lane), then (worker, floor) pairs in the order to
# try. `floor` is the worker's waiting queue as this replica last saw it (its report plus what is
# on this replica's wire), so preempted jobs count. The first worker with room gets the job: a
# slot is counted and filed under the replica. Returns that worker's 1-based position, or 0.
#
# Arbitration: a replica refused files its head job (class, counter, when) in P:heads:MODEL; a
# take is refused while another live replica filed, within HEAD_MS, a head of a more urgent class
# (by_class) or of the same class with a smaller counter. So a freed slot goes to the most
# deserving head in the cluster, not to whichever replica's take reaches Redis first. A head is
# dropped when its replica takes a slot, when it is older than HEAD_MS (a refused replica files
# again at every retry, SLOT_RETRY_S), or when its replica's lease has lapsed.
TAKE_SLOT = _COMMON + r"""
local HEAD_MS = 250
local replica, lease, slot = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local class, limit, by_class = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7] == '1'
local model, counter = ARGV[8], tonumber(ARGV[9])
local now = now_ms()
redis.call('ZADD', P .. ':replicas', now + lease, replica)
sweep(now)
local heads = P .. ':heads:' .. model
local function file_head()
  redis.call('HSET', heads, replica, class .. ':' .. ARGV[9] .. ':' .. now)
  redis.call('PEXPIRE', heads, lease)
  return 0
end
local filed = redis.call('HGETALL', heads)
for j = 1, #filed, 2 do
  local other = filed[j]
  if other ~= replica then
    local c, v, t = string.match(filed[j + 1], '^(%d+):(.-):(%d+)$')
    c, v, t = tonumber(c), tonumber(v), tonumber(t)
    local deadline = tonumber(redis.call('ZSCORE', P .. ':replicas', other))
    if not c or not v or t < now - HEAD_MS or not deadline or deadline <= now then
      redis.call('HDEL', heads, other)
    elseif (by_class and c < class) or ((c == class or not by_class) and v < counter) then
      return file_head()
    end
  end
end
for i = 10, #ARGV, 2 do
  local worker = ARGV[i]
  local counts = redis.call('HGETALL', P .. ':ws:' .. worker)
  local total, ahead, behind = 0, 0, false
  for j = 1, #counts, 2 do
    local c, n = tonumber(counts[j]), tonumber(counts[j + 1])
    total = total + n
    if c <= class then ahead = ahead + n elseif n > 0 then behind = true end
  end
  -- has_room (gateway/dispatch/slots.py) on the counts of every replica
  local room = math.max(total, tonumber(ARGV[i + 1])) < limit or (by_class and behind and ahead < limit)
  if room then
    redis.call('HINCRBY', P .. ':ws:' .. worker, class, 1)
    redis.call('HSET', P .. ':slots:' .. replica, slot, class .. ':' .. worker)
    redis.call('HDEL', heads, replica)
    return (i - 8) / 2
  end
end
return file_head()
"""

# ARGV: prefix, replica, channel, then slots. Ends them (job started, finished, aborted, worker
# lost); one that is gone (never taken, or swept with its replica) is skipped. When some ended,
# announces it on the channel (the replica id as message), in the same atomic step, so every
# replica's dispatch loop wakes for the freed room, not only this one's. The channel is named by
# the caller: pub/sub ignores the database number, so its name carries it (cluster/shared.py).
# Returns how many ended.
RELEASE_SLOTS = _COMMON + r"""
local ended = 0
for i = 4, #ARGV do ended = ended + slot_release(ARGV[2], ARGV[i]) end
if ended > 0 then redis.call('PUBLISH', ARGV[3], ARGV[2]) end
return ended
"""

# ARGV: prefix, replica, lease ms, then JSON {lane: {c: {tenant: charge}, b: [backlogged here],
# j: [joined here since the last sync], l: last served counter here}} for every lane. Adds the
# charges to the cluster's counters P:vtc:LANE (tenant -> tokens / weight), files the replica's
# backlogged tenants in P:vb:R (expires with its lease), and lifts each joined tenant that no
# other live replica holds backlogged to the smallest counter of the tenants backlogged anywhere
# (the VTC lift, cluster-wide: idle time banks no credit on any replica). Returns JSON
# {lane: {tenant: counter}} for the tenants backlogged or joined here.
SYNC_FAIR = _COMMON + r"""
local replica, lease = ARGV[2], tonumber(ARGV[3])
local now = now_ms()
redis.call('ZADD', P .. ':replicas', now + lease, replica)
local mine = P .. ':vb:' .. replica
local others = {}
for _, r in ipairs(redis.call('ZRANGEBYSCORE', P .. ':replicas', now, '+inf')) do
  if r ~= replica then table.insert(others, r) end
end
local out = {}
for lane, l in pairs(cjson.decode(ARGV[4])) do
  local key = P .. ':vtc:' .. lane
  for tenant, amount in pairs(l.c) do redis.call('HINCRBYFLOAT', key, tenant, amount) end
  local function counter(t) return tonumber(redis.call('HGET', key, t)) or 0 end
  local elsewhere, joined = {}, {}
  for _, r in ipairs(others) do
    local raw = redis.call('HGET', P .. ':vb:' .. r, lane)
    if raw then for _, t in ipairs(cjson.decode(raw)) do elsewhere[t] = true end end
  end
  for _, t in ipairs(l.j) do joined[t] = true end
  local floor = nil
  local function consider(t)
    local v = counter(t)
    if floor == nil or v < floor then floor = v end
  end
  for t in pairs(elsewhere) do consider(t) end
  for _, t in ipairs(l.b) do if not joined[t] then consider(t) end end
  if floor == nil then floor = tonumber(l.l) end
  local counters = {}
  for t in pairs(joined) do
    if not elsewhere[t] and counter(t) < floor then redis.call('HSET', key, t, floor) end
    counters[t] = counter(t)
  end
  for _, t in ipairs(l.b) do counters[t] = counter(t) end
  redis.call('HSET', mine, lane, cjson.encode(l.b))
  out[lane] = counters
end
redis.call('PEXPIRE', mine, lease)
return cjson.encode(out)
"""

# ---- replica liveness (batch ownership) -------------------------------------------------------

# ARGV: prefix, replica. Returns 1 while the replica's lease is in the future, else 0 (a replica
# that never took a lease, or gave it up, or stopped renewing it).
ALIVE = _COMMON + r"""
local deadline = redis.call('ZSCORE', P .. ':replicas', ARGV[2])
if deadline and tonumber(deadline) > now_ms() then return 1 end
return 0
"""
