#!lua name=herdwick

--[[
herdwick's Redis functions: the only code that mutates hot state.

Every call takes one key, the pool's key base `P:{pool}` (P = key prefix; the
braces are a Redis Cluster hash tag, so every key derived from it lives in
the pool's slot). Derived keys:
  base..':ready'     stream of executions ready to lease (consumer group `workers`)
  base..':x:'..id    hash: hot state of execution `id`: attempt, state, job_id,
                     tenant_id, scheduled_for, timeout_seconds, max_attempts,
                     backoff_ms (from hw_publish); lease_owner, lease_until (ms),
                     leased_at (ms, the attempt's first lease) and retry_at (ms)
                     from the lease functions. The lease fields mean something
                     only while state is `leased`.
  base..':leases'    sorted set: execution id, scored by lease_until (ms), for hw_expire
  base..':events'    stream of what happened, read by the scheduler's event actor
  base..':grants'    hash: stream slots hw_admit granted that no hw_publish has filled
                     yet, by the second they were granted (field: ms // 1000); each
                     second's slots lapse RESERVED_TTL_MS after it, so a scheduler that
                     died holding some gives them back on time, however often the live
                     ones ask
  base..':drain'     hash: leases counted over the current second (since_ms, count) and
                     the smoothed lease rate per second (rate): the default bound
States: ready (published), leased, retry_wait, dead, done, canceled.
Times are integer milliseconds of this server's clock (TIME), the one clock
that workers and schedulers agree on.

The attempt is the fencing token: a worker call whose attempt is not the
current one, whose lease lapsed, or that another worker holds, answers
LEASE_LOST and changes nothing.

Every events entry has one field, `e`: one event, or an array of the events of
one batch call (hw_lease_batch, hw_complete_batch), in order. (One field, and
one entry a batch: the event actor reads tens of thousands of events a
second.) An event is a JSON object whose values are strings: type,
execution_id, attempt, job_id, tenant_id, scheduled_for, worker_id, at_ms,
and by type:
  leased     lease_until_ms
  completed  result (JSON text as the worker gave it), started_ms
  failed     error (JSON text), retryable ('0'|'1'), outcome ('retry'|'dead'),
             retry_at_ms (only when outcome is retry), started_ms
(started_ms, from library version 8: when the attempt was first leased, so an
outcome read before its `leased` event, by another consumer, still says when
the attempt started.)
  expired    as failed; error {"type":"LeaseExpired","message":"lease expired"}, retryable '1',
             worker_id the owner whose lease lapsed
  (a failed event with deferred '1', from library version 13, is an attempt put off
  without counting against max_attempts: hw_fail's defer flag)
  canceled   nothing more (worker_id is the holder's, '' if none)
  (a completed event with recovered '1', from library version 15, is hw_recover's: a
  worker's completion sent again after Redis lost its data)
  stale      call ('heartbeat'|'complete'|'fail'), current_attempt ('' if the hash is
             gone): from library version 14, a worker call the fence refused that came
             from an attempt whose lease lapsed or that a later attempt replaced, so its
             handler may have acted beside another; attempt is the caller's, and
             job_id, tenant_id and scheduled_for are '' when the hash is gone
]]

local LIBRARY_VERSION = '19'
local HOT_TTL_MS = 7 * 24 * 3600 * 1000
-- A done, dead or canceled hash keeps only its attempt and state, for this long:
-- a late republish of that attempt (a scheduler retrying a publish whose reply it
-- lost) must not revive it, and the sweeper (which waits until the events of this
-- long ago are applied) must not take it for lost. Then it goes, so what Redis holds
-- grows with the work in flight and the last minute's, not with all of it.
local TERMINAL_TTL_MS = 60 * 1000
-- ...and once Postgres has the outcome (hw_settled), only this long: what could still
-- come for that attempt is a publish retried after a lost reply, within seconds.
local SETTLED_TTL_MS = 10 * 1000
local SPENT_FIELDS = {'lease_owner', 'lease_until', 'job_id', 'tenant_id', 'scheduled_for',
                      'timeout_seconds', 'max_attempts', 'backoff_ms', 'leased_at', 'retry_at',
                      'deferred'}
local RETRY_CAP_MS = 3600 * 1000
local EXPIRED_ERROR = '{"type":"LeaseExpired","message":"lease expired"}'
local PUBLISH_FIELDS = 10  -- and an optional 11th, the http target's URL
-- The ready stream's default bound: the workers' smoothed lease rate times READY_WINDOW_MS,
-- within [READY_MIN, READY_MAX] unless the scheduler gives one (hw_admit's cap).
local READY_WINDOW_MS = 1000
local READY_MIN = 1000
local READY_MAX = 20000
local RESERVED_TTL_MS = 10000
local GRANT_SECOND_MS = 1000
local DRAIN_SECOND_MS = 1000
local DRAIN_STALE_MS = 10000

-- Server time: milliseconds, and the microseconds of the second (for jitter).
local function now_ms()
  local t = redis.call('TIME')
  local us = tonumber(t[2])
  return tonumber(t[1]) * 1000 + math.floor(us / 1000), us
end

-- Lua numbers are doubles; '%d' writes millisecond times without an exponent.
local function fmt(n)
  return string.format('%d', n)
end

--[[
Stream slots granted and not yet filled (hw_admit grants them, hw_publish fills them),
kept by the second they were granted in, so that each grant lapses RESERVED_TTL_MS (and
at most a second) after it was made. One counter, whose expiry every hw_admit renews,
would keep a dead scheduler's grants for as long as the live ones keep asking: a node
that died holding the whole bound would leave its pool no room at all. A publish or a
release cannot say whose grant it fills, so it gives back the newest slots first: what
is left is the oldest and lapses first, so a dead node's slots never outlive the TTL.
]]
-- {seconds, newest first}, second -> slots, their total; lapsed seconds are deleted.
local function live_grants(key, now)
  local flat = redis.call('HGETALL', key)
  local oldest = math.floor((now - RESERVED_TTL_MS) / GRANT_SECOND_MS)
  local seconds, slots, total = {}, {}, 0
  for i = 1, #flat, 2 do
    local second, n = tonumber(flat[i]), tonumber(flat[i + 1]) or 0
    if not second or second < oldest or n <= 0 then
      redis.call('HDEL', key, flat[i])
    else
      seconds[#seconds + 1] = second
      slots[second] = n
      total = total + n
    end
  end
  table.sort(seconds, function(a, b) return a > b end)
  return seconds, slots, total
end

-- Gives back n granted slots, the newest first; returns the slots still granted.
local function give_back(key, n, now)
  local seconds, slots, total = live_grants(key, now)
  for _, second in ipairs(seconds) do
    if n <= 0 then
      break
    end
    local taken = math.min(n, slots[second])
    if taken == slots[second] then
      redis.call('HDEL', key, fmt(second))
    else
      redis.call('HINCRBY', key, fmt(second), -taken)
    end
    n, total = n - taken, total - taken
  end
  return total
end

-- Grants n slots in the current second; returns the slots now granted.
local function grant(key, n, total, now)
  if n > 0 then
    redis.call('HINCRBY', key, fmt(math.floor(now / GRANT_SECOND_MS)), n)
    total = total + n
  end
  if total > 0 then
    redis.call('PEXPIRE', key, RESERVED_TTL_MS + GRANT_SECOND_MS)  -- the last second's end
  end
  return total
end

--[[
hw_publish  KEYS[1] = P:{pool}
            ARGV[1] = a MessagePack array with one array of 10 or 11 strings per execution:
                   execution_id, attempt (decimal, from 1), job_id, tenant_id,
                   scheduled_for (RFC 3339 UTC), payload (JSON text),
                   timeout_seconds, idempotency_key, max_attempts, backoff_ms
                   (the last two stay in hot state, for hw_fail; not on the stream),
                   and optionally target (an http job's URL: the stream field `target`
                   when not empty)
            (one argument rather than 10 per execution: packing thousands of arguments
            a second was a tenth of the scheduler's time in a herd; MessagePack
            because cmsgpack unpacks it in a quarter less time than cjson does JSON)
            ARGV[2] = optional: stream slots this publish fills of those hw_admit granted
                   (given back to P:{pool}:grants whether or not each was added)
Writes each execution's hot state and XADDs it to P:{pool}:ready, unless
that attempt (or a later one) was published already: republishing is a
no-op, so a scheduler may retry a batch safely, and a done or canceled
attempt is never revived by a late publish of itself. Nor does a later attempt
follow a done one (library 18): the execution succeeded and its `completed`
event is on its way to Postgres, which takes it over the sweeper's bump (a
worker's hw_recover can land between the sweeper's look at Redis and its publish).
Returns the number of executions added to the stream.
]]
local function hw_publish(keys, args)
  local base = keys[1]
  local ready = base .. ':ready'
  local added = 0
  local ok, items = pcall(cmsgpack.unpack, args[1] or '')
  if not ok or type(items) ~= 'table' or (#items == 0 and next(items) ~= nil) then
    return redis.error_reply('ERR hw_publish takes one MessagePack array of executions')
  end
  for _, x in ipairs(items) do
    if type(x) ~= 'table' or (#x ~= PUBLISH_FIELDS and #x ~= PUBLISH_FIELDS + 1) then
      return redis.error_reply('ERR hw_publish: each execution is an array of 10 or 11 strings')
    end
    local execution_id, attempt = x[1], x[2]
    local hot = base .. ':x:' .. execution_id
    local had = redis.call('HMGET', hot, 'attempt', 'state')
    local current = tonumber(had[1] or '0')
    if current < tonumber(attempt) and had[2] ~= 'done' then
      redis.call('HSET', hot, 'attempt', attempt, 'state', 'ready', 'job_id', x[3],
                 'tenant_id', x[4], 'scheduled_for', x[5], 'timeout_seconds', x[7],
                 'max_attempts', x[9], 'backoff_ms', x[10])
      redis.call('PEXPIRE', hot, HOT_TTL_MS)
      if x[11] and x[11] ~= '' then
        redis.call('XADD', ready, '*',
                   'execution_id', execution_id, 'job_id', x[3], 'tenant_id', x[4],
                   'attempt', attempt, 'scheduled_for', x[5], 'payload', x[6],
                   'timeout_seconds', x[7], 'idempotency_key', x[8], 'target', x[11])
      else
        redis.call('XADD', ready, '*',
                   'execution_id', execution_id, 'job_id', x[3], 'tenant_id', x[4],
                   'attempt', attempt, 'scheduled_for', x[5], 'payload', x[6],
                   'timeout_seconds', x[7], 'idempotency_key', x[8])
      end
      added = added + 1
    end
  end
  local filled = tonumber(args[2] or '0') or 0
  if filled > 0 then
    give_back(base .. ':grants', filled, (now_ms()))
  end
  return added
end

--[[
hw_version  no keys, no arguments -> the library's version string, so a
process can tell whether the loaded library is the one it ships.
]]
local function hw_version(keys, args)
  return LIBRARY_VERSION
end

-- Shared by the worker-protocol functions below ------------------------------

local LEASE_LOST = {ok = 'LEASE_LOST'}  -- status replies, as redis.status_reply builds them
local OK = {ok = 'OK'}
local DEAD = {ok = 'DEAD'}
local HOT_FIELDS = {'attempt', 'state', 'lease_owner', 'lease_until', 'job_id', 'tenant_id',
                    'scheduled_for', 'max_attempts', 'backoff_ms', 'leased_at', 'lapsed',
                    'deferred'}

-- A malformed argument is the caller's bug, not a lost lease: an error reply.
local function bad_arg(fn, what)
  error({err = 'ERR ' .. fn .. ': ' .. what})
end

local function int_arg(fn, name, value)
  local n = tonumber(value)
  if not n or n ~= math.floor(n) then
    bad_arg(fn, name .. ' must be an integer')
  end
  return n
end

-- Seconds, decimals allowed (tests lease for a fraction of a second); > 0.
local function lease_ms_arg(fn, value)
  local s = tonumber(value)
  if not s or s <= 0 then
    bad_arg(fn, 'lease_seconds must be a positive number')
  end
  return math.max(1, math.floor(s * 1000))
end

local function worker_arg(fn, value)
  if not value or value == '' then
    bad_arg(fn, 'worker_id must not be empty')
  end
  return value
end

-- An attempt reached a final state: the hash shrinks to attempt and state, and expires.
local function finish(hot, state)
  redis.call('HSET', hot, 'state', state)
  redis.call('HDEL', hot, unpack(SPENT_FIELDS))
  redis.call('PEXPIRE', hot, TERMINAL_TTL_MS)
end

-- The execution's hot state as a table (absent fields false), or nil if unknown.
local function load_hot(hot)
  local values = redis.call('HMGET', hot, unpack(HOT_FIELDS))
  if not values[1] then
    return nil
  end
  local h = {}
  for i, field in ipairs(HOT_FIELDS) do
    h[field] = values[i]
  end
  return h
end

-- Does worker_id hold a live lease on this attempt?
local function holds(h, attempt, worker_id, now)
  return h ~= nil and tonumber(h.attempt) == attempt and h.state == 'leased'
         and h.lease_owner == worker_id and (tonumber(h.lease_until) or 0) > now
end

-- An event: XADDed at once, or, given `into` (a batch function's list), added to
-- it for flush() to XADD as one entry.
local function emit(base, kind, execution_id, h, worker_id, now, extra, into)
  local event = {type = kind, execution_id = execution_id, attempt = h.attempt,
                 job_id = h.job_id or '', tenant_id = h.tenant_id or '',
                 scheduled_for = h.scheduled_for or '', worker_id = worker_id or '',
                 at_ms = fmt(now)}
  -- An outcome of a leased attempt: leased_at is this attempt's (set at its first lease).
  if (kind == 'completed' or kind == 'failed' or kind == 'expired') and h.leased_at then
    event.started_ms = h.leased_at
  end
  for i = 1, #extra, 2 do
    event[extra[i]] = extra[i + 1]
  end
  if into then
    into[#into + 1] = event
  else
    redis.call('XADD', base .. ':events', '*', 'e', cjson.encode(event))
  end
end

local function flush(base, events)
  if #events > 0 then
    redis.call('XADD', base .. ':events', '*', 'e', cjson.encode(events))
  end
end

-- A worker call the fence refused. If the caller's attempt was reaped (its lease
-- lapsed: `lapsed` names it) or a later attempt replaced it, its handler may have acted
-- while another ran or will run: a `stale` event lets Postgres record that on the
-- execution. Not a repeat of a call that settled (its reply was lost), a call after a
-- cancel, nor one for an attempt not yet published. An unknown hash (expired) is
-- reported too; Postgres, which knows the attempts, judges it.
local function refused(base, call, execution_id, h, attempt, worker_id, now, into)
  local current = ''
  if h ~= nil then
    local cur = tonumber(h.attempt) or 0
    local mine = fmt(attempt) .. ':' .. worker_id
    local lapsed = cur == attempt and (h.lapsed == mine or (h.state == 'leased'
                   and h.lease_owner == worker_id and (tonumber(h.lease_until) or 0) <= now))
    if cur <= attempt and not lapsed then
      return
    end
    current = h.attempt
  end
  local known = h or {}
  emit(base, 'stale', execution_id,
       {attempt = fmt(attempt), job_id = known.job_id, tenant_id = known.tenant_id,
        scheduled_for = known.scheduled_for},
       worker_id, now, {'call', call, 'current_attempt', current}, into)
end

--[[
Jitter without math.random: Redis seeds math.random the same way for every
call, so a herd failing together would retry together. Instead mix the
microseconds of TIME with a cheap hash of the execution id (31-multiplier
string hash, then Knuth's multiplicative constant on the microseconds):
executions failing in the same call get different delays through the id,
one execution's successive attempts through the clock. Not cryptographic;
it only spreads retries. Every product stays below 2^53, exact in a double.
]]
local function jitter(execution_id, us)
  local h = 0
  for i = 1, #execution_id do
    h = (h * 31 + string.byte(execution_id, i)) % 4294967296
  end
  return (h + us * 2654435761) % 4294967296
end

-- Delay before the next attempt: uniform in [d/2, d], d = backoff_ms * 2^(tried-1), tried
-- the attempts made less those deferred, capped at RETRY_CAP_MS (the cap applies to d,
-- before the jitter).
local function retry_delay_ms(backoff_ms, tried, execution_id, us)
  local d = math.floor(math.min(backoff_ms * 2 ^ (tried - 1), RETRY_CAP_MS))
  local low = math.ceil(d / 2)
  return low + jitter(execution_id, us) % (d - low + 1)
end

-- A failed attempt (hw_fail, or hw_expire for a lapsed lease): retry_wait with
-- a retry time, or dead. Returns retry_at_ms or DEAD. min_delay_ms (a target's
-- Retry-After) is the least delay before the next attempt. A deferred attempt
-- (a worker putting it off: a circuit breaker open) waits exactly min_delay_ms and
-- does not count against max_attempts, which grows by one with it.
local function settle_failure(base, kind, execution_id, h, worker_id, error_json, retryable,
                              now, us, min_delay_ms, deferred)
  local hot = base .. ':x:' .. execution_id
  local attempt = tonumber(h.attempt)
  local max_attempts = tonumber(h.max_attempts) or 1
  local extra = {'error', error_json, 'retryable', retryable and '1' or '0'}
  local least_ms = math.min(min_delay_ms or 0, RETRY_CAP_MS * 24)  -- a day at most
  local reply
  if deferred then
    local retry_at = now + least_ms
    redis.call('HSET', hot, 'state', 'retry_wait', 'retry_at', fmt(retry_at),
               'max_attempts', fmt(max_attempts + 1),
               'deferred', fmt((tonumber(h.deferred) or 0) + 1))
    extra[#extra + 1], extra[#extra + 2] = 'outcome', 'retry'
    extra[#extra + 1], extra[#extra + 2] = 'retry_at_ms', fmt(retry_at)
    extra[#extra + 1], extra[#extra + 2] = 'deferred', '1'
    reply = retry_at
  elseif not retryable or attempt >= max_attempts then
    finish(hot, 'dead')
    extra[#extra + 1], extra[#extra + 2] = 'outcome', 'dead'
    reply = DEAD
  else
    local backoff_ms = tonumber(h.backoff_ms) or 0
    -- Deferred attempts were never tried: the backoff grows with the tried ones alone (a
    -- hash rebuilt after Redis lost its data no longer knows them, and counts them again).
    local tried = math.max(1, attempt - (tonumber(h.deferred) or 0))
    local delay = math.max(retry_delay_ms(backoff_ms, tried, execution_id, us), least_ms)
    local retry_at = now + delay
    redis.call('HSET', hot, 'state', 'retry_wait', 'retry_at', fmt(retry_at))
    extra[#extra + 1], extra[#extra + 2] = 'outcome', 'retry'
    extra[#extra + 1], extra[#extra + 2] = 'retry_at_ms', fmt(retry_at)
    reply = retry_at
  end
  redis.call('ZREM', base .. ':leases', execution_id)
  emit(base, kind, execution_id, h, worker_id, now, extra)
  return reply
end

--[[
hw_lease  KEYS[1] = P:{pool}
          ARGV = worker_id, lease_seconds (> 0, decimals allowed),
                 execution_id, attempt (decimal)
Takes the lease on a ready attempt: state leased, owner worker_id, until
now + lease; XADDs `leased` to the events stream. The same worker leasing
again while its lease is live extends it (idempotent; no second event).
LEASE_LOST if the execution is unknown, the attempt is not the current one,
another worker holds it (live or lapsed: a lapsed lease is hw_expire's to
settle, not the next comer's), its own lease already lapsed, or the
attempt is in retry_wait or finished.
Reply: lease_until_ms (integer) | LEASE_LOST (status).
]]
-- One lease (hw_lease, hw_lease_batch): lease_until_ms or LEASE_LOST.
local function lease_one(base, worker_id, lease_ms, execution_id, attempt, now, events)
  local hot = base .. ':x:' .. execution_id
  local h = load_hot(hot)
  if h == nil or tonumber(h.attempt) ~= attempt then
    return LEASE_LOST, false
  end
  local first = h.state == 'ready'
  if not first and not holds(h, attempt, worker_id, now) then
    return LEASE_LOST, false
  end
  local lease_until = now + lease_ms
  if first then
    redis.call('HSET', hot, 'state', 'leased', 'lease_owner', worker_id,
               'lease_until', fmt(lease_until), 'leased_at', fmt(now))
  else
    redis.call('HSET', hot, 'lease_until', fmt(lease_until))
  end
  redis.call('ZADD', base .. ':leases', lease_until, execution_id)
  if first then
    emit(base, 'leased', execution_id, h, worker_id, now, {'lease_until_ms', fmt(lease_until)},
         events)
  end
  return lease_until, first
end

-- `n` ready executions were leased for the first time: the pool's lease rate (the
-- default bound of its stream) counts them.
local function count_leases(base, n, now)
  if n == 0 then
    return
  end
  local drain = base .. ':drain'
  local d = redis.call('HMGET', drain, 'since_ms', 'count', 'rate')
  local since, count, rate = tonumber(d[1]), tonumber(d[2]) or 0, tonumber(d[3]) or 0
  if not since or now - since >= DRAIN_STALE_MS then
    redis.call('HSET', drain, 'since_ms', fmt(now), 'count', n)
  elseif now - since >= DRAIN_SECOND_MS then
    local measured = count * 1000 / (now - since)
    rate = rate > 0 and (rate + measured) / 2 or measured
    redis.call('HSET', drain, 'since_ms', fmt(now), 'count', n, 'rate', tostring(rate))
  else
    redis.call('HINCRBY', drain, 'count', n)
  end
  redis.call('PEXPIRE', drain, HOT_TTL_MS)
end

local function hw_lease(keys, args)
  local worker_id = worker_arg('hw_lease', args[1])
  local lease_ms = lease_ms_arg('hw_lease', args[2])
  local attempt = int_arg('hw_lease', 'attempt', args[4])
  local now = now_ms()
  local reply, first = lease_one(keys[1], worker_id, lease_ms, args[3], attempt, now)
  count_leases(keys[1], first and 1 or 0, now)
  return reply
end

--[[
hw_lease_batch  KEYS[1] = P:{pool}
                ARGV = worker_id, lease_seconds, then execution_id, attempt pairs
hw_lease for each pair, in one call (the SDK leases what one read returned);
their `leased` events go as one events entry.
Reply: an array, one hw_lease reply per pair, in order.
]]
local function hw_lease_batch(keys, args)
  local worker_id = worker_arg('hw_lease_batch', args[1])
  local lease_ms = lease_ms_arg('hw_lease_batch', args[2])
  if #args % 2 ~= 0 then
    bad_arg('hw_lease_batch', 'takes execution_id, attempt pairs')
  end
  local now = now_ms()
  local replies, events, firsts = {}, {}, 0
  for i = 3, #args, 2 do
    local attempt = int_arg('hw_lease_batch', 'attempt', args[i + 1])
    local reply, first = lease_one(keys[1], worker_id, lease_ms, args[i], attempt, now, events)
    replies[#replies + 1] = reply
    if first then
      firsts = firsts + 1
    end
  end
  flush(keys[1], events)
  count_leases(keys[1], firsts, now)
  return replies
end

--[[
hw_heartbeat  KEYS[1] = P:{pool}
              ARGV = execution_id, attempt, worker_id, lease_seconds (> 0)
Extends worker_id's live lease on the attempt to now + lease. No event.
Reply: lease_until_ms (integer) | LEASE_LOST (status) if the attempt is not
current, not leased, leased by someone else, or the lease lapsed.
]]
local function hw_heartbeat(keys, args)
  local base = keys[1]
  local execution_id = args[1]
  local attempt = int_arg('hw_heartbeat', 'attempt', args[2])
  local worker_id = worker_arg('hw_heartbeat', args[3])
  local lease_ms = lease_ms_arg('hw_heartbeat', args[4])
  local hot = base .. ':x:' .. execution_id
  local now = now_ms()
  local h = load_hot(hot)
  if not holds(h, attempt, worker_id, now) then
    refused(base, 'heartbeat', execution_id, h, attempt, worker_id, now)
    return LEASE_LOST
  end
  local lease_until = now + lease_ms
  redis.call('HSET', hot, 'lease_until', fmt(lease_until))
  redis.call('ZADD', base .. ':leases', lease_until, execution_id)
  return lease_until
end

--[[
hw_complete  KEYS[1] = P:{pool}
             ARGV = execution_id, attempt, worker_id, result_json (JSON text)
Finishes the attempt: state done, lease dropped, `completed` XADDed with the
result as given. The hash keeps attempt and state for TERMINAL_TTL_MS (60 s; SETTLED_TTL_MS
once Postgres has the outcome, see hw_settled), then expires; a duplicate complete gets
LEASE_LOST either way.
Reply: OK | LEASE_LOST (status; same checks as hw_heartbeat).
]]
-- One completion (hw_complete, hw_complete_batch): OK or LEASE_LOST.
local function complete_one(base, execution_id, attempt, worker_id, result_json, now, events)
  local hot = base .. ':x:' .. execution_id
  local h = load_hot(hot)
  if not holds(h, attempt, worker_id, now) then
    refused(base, 'complete', execution_id, h, attempt, worker_id, now, events)
    return LEASE_LOST
  end
  finish(hot, 'done')
  redis.call('ZREM', base .. ':leases', execution_id)
  emit(base, 'completed', execution_id, h, worker_id, now, {'result', result_json}, events)
  return OK
end

local function hw_complete(keys, args)
  local attempt = int_arg('hw_complete', 'attempt', args[2])
  local worker_id = worker_arg('hw_complete', args[3])
  return complete_one(keys[1], args[1], attempt, worker_id, args[4] or 'null', (now_ms()))
end

--[[
hw_complete_batch  KEYS[1] = P:{pool}
                   ARGV = worker_id, then execution_id, attempt, result_json triples
hw_complete for each triple, in one call (the SDK sends what finished
meanwhile); their `completed` events go as one events entry.
Reply: an array, one hw_complete reply per triple, in order.
]]
local function hw_complete_batch(keys, args)
  local worker_id = worker_arg('hw_complete_batch', args[1])
  if #args % 3 ~= 1 then
    bad_arg('hw_complete_batch', 'takes execution_id, attempt, result_json triples')
  end
  local now = now_ms()
  local replies, events = {}, {}
  for i = 2, #args, 3 do
    local attempt = int_arg('hw_complete_batch', 'attempt', args[i + 1])
    replies[#replies + 1] = complete_one(keys[1], args[i], attempt, worker_id, args[i + 2], now,
                                         events)
  end
  flush(keys[1], events)
  return replies
end

--[[
hw_recover  KEYS[1] = P:{pool}
            ARGV = worker_id, then execution_id, attempt, job_id, tenant_id, scheduled_for,
                   started_ms, finished_ms, result_json for each completion
A worker's recent completions, sent again once Redis came back without its data (a new
epoch), or after the worker could not reach it for a while (a failover, whose new
primary may lack the last writes the old one acknowledged): the `completed` events of
some had not reached Postgres, which would run them again. An execution Redis has no
hot state of, or whose state is still this attempt ready, or leased by this worker (the
completion was lost, not refused), is written as done (for TERMINAL_TTL_MS: the
sweeper sees it is not lost; a lease of that attempt is refused from now on) and XADDs
`completed` as hw_complete would have, with `recovered` '1' and at_ms the time the
worker finished it; any other state (done, another holder, a later attempt) is left
alone. Postgres applies the event only if it still has that attempt queued or running.
Reply: how many were recovered.
]]
local function hw_recover(keys, args)
  local base = keys[1]
  local worker_id = worker_arg('hw_recover', args[1])
  if (#args - 1) % 8 ~= 0 then
    bad_arg('hw_recover', 'takes completions of 8 fields each')
  end
  local events, recovered = {}, 0
  for i = 2, #args, 8 do
    local execution_id = args[i]
    local attempt = int_arg('hw_recover', 'attempt', args[i + 1])
    local finished = int_arg('hw_recover', 'finished_ms', args[i + 6])
    local hot = base .. ':x:' .. execution_id
    local h = load_hot(hot)
    local lost = h ~= nil and tonumber(h.attempt) == attempt
                 and (h.state == 'ready' or (h.state == 'leased' and h.lease_owner == worker_id))
    if h == nil or lost then
      if lost then
        redis.call('HDEL', hot, unpack(SPENT_FIELDS))
        redis.call('ZREM', base .. ':leases', execution_id)
      end
      redis.call('HSET', hot, 'attempt', fmt(attempt), 'state', 'done')
      redis.call('PEXPIRE', hot, TERMINAL_TTL_MS)
      emit(base, 'completed', execution_id,
           {attempt = fmt(attempt), job_id = args[i + 2], tenant_id = args[i + 3],
            scheduled_for = args[i + 4], leased_at = args[i + 5]},
           worker_id, finished, {'result', args[i + 7], 'recovered', '1'}, events)
      recovered = recovered + 1
    end
  end
  flush(base, events)
  return recovered
end

--[[
hw_fail  KEYS[1] = P:{pool}
         ARGV = execution_id, attempt, worker_id, error_json (JSON text),
                retryable ('1' | '0'), optionally min_delay_ms (the least delay
                before the next attempt: a Retry-After; '0' none) and defer ('1': put
                the attempt off for exactly min_delay_ms without counting it)
Ends the attempt as failed. Dead when retryable is '0' or attempt >=
max_attempts; otherwise retry_wait until now + delay, the delay uniform in
[d/2, d] ms, d = backoff_ms * 2^(attempt-1) capped at 1 h, and at least
min_delay_ms (capped at a day). XADDs `failed` with the outcome; the scheduler
republishes attempt + 1 at retry_at_ms. A deferred attempt is never dead.
Reply: retry_at_ms (integer) | DEAD | LEASE_LOST (status; same checks as
hw_heartbeat).
]]
local function hw_fail(keys, args)
  local base = keys[1]
  local execution_id = args[1]
  local attempt = int_arg('hw_fail', 'attempt', args[2])
  local worker_id = worker_arg('hw_fail', args[3])
  local error_json = args[4] or 'null'
  if args[5] ~= '0' and args[5] ~= '1' then
    bad_arg('hw_fail', "retryable must be '0' or '1'")
  end
  local min_delay_ms = int_arg('hw_fail', 'min_delay_ms', args[6] or '0')
  if min_delay_ms < 0 then
    bad_arg('hw_fail', 'min_delay_ms must be >= 0')
  end
  local deferred = args[7] == '1'
  local h = load_hot(base .. ':x:' .. execution_id)
  local now, us = now_ms()
  if not holds(h, attempt, worker_id, now) then
    refused(base, 'fail', execution_id, h, attempt, worker_id, now)
    return LEASE_LOST
  end
  return settle_failure(base, 'failed', execution_id, h, worker_id, error_json,
                        args[5] == '1' or deferred, now, us, min_delay_ms, deferred)
end

--[[
hw_expire  KEYS[1] = P:{pool}
           ARGV = limit (executions per call, >= 1)
The reaper's call, about once a second. Each lease in P:{pool}:leases due by
now whose execution is still leased and lapsed becomes a failed attempt,
exactly as hw_fail with retryable '1' and error {"type":"LeaseExpired","message":"lease expired"}
(retry or dead by max_attempts), XADDed as `expired` with the lapsed owner
as worker_id. Entries of executions no longer leased are dropped.
Reply: array of the execution ids expired (at most limit).
]]
local function hw_expire(keys, args)
  local base = keys[1]
  local limit = int_arg('hw_expire', 'limit', args[1])
  if limit < 1 then
    bad_arg('hw_expire', 'limit must be >= 1')
  end
  local leases = base .. ':leases'
  local now, us = now_ms()
  local expired = {}
  for _, execution_id in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', now,
                                           'LIMIT', 0, limit)) do
    local h = load_hot(base .. ':x:' .. execution_id)
    local lease_until = h and tonumber(h.lease_until) or 0
    if h == nil or h.state ~= 'leased' then
      redis.call('ZREM', leases, execution_id)
    elseif lease_until > now then
      -- A live lease under a stale score (not written by these functions):
      -- re-score it rather than stop watching it.
      redis.call('ZADD', leases, lease_until, execution_id)
    else
      -- Remembered, so the lapsed holder's late calls are known for what they are.
      redis.call('HSET', base .. ':x:' .. execution_id, 'lapsed', h.attempt .. ':' .. h.lease_owner)
      settle_failure(base, 'expired', execution_id, h, h.lease_owner, EXPIRED_ERROR, true,
                     now, us)
      expired[#expired + 1] = execution_id
    end
  end
  return expired
end

--[[
hw_cancel  KEYS[1] = P:{pool}
           ARGV = execution_id
The job was canceled, or an overlap=replace occurrence supersedes this one.
A ready, leased or retry_wait execution becomes canceled (its lease
dropped; the holder's next heartbeat/complete/fail gets LEASE_LOST), and a
ready or leased one XADDs `canceled`. Finished and unknown executions are
left alone: idempotent.
Reply: OK (status).
]]
local function hw_cancel(keys, args)
  local base = keys[1]
  local execution_id = args[1]
  local hot = base .. ':x:' .. execution_id
  local h = load_hot(hot)
  if h == nil or (h.state ~= 'ready' and h.state ~= 'leased' and h.state ~= 'retry_wait') then
    return OK
  end
  local now = now_ms()
  finish(hot, 'canceled')
  redis.call('ZREM', base .. ':leases', execution_id)

  if h.state ~= 'retry_wait' then
    local holder = h.state == 'leased' and h.lease_owner or ''
    emit(base, 'canceled', execution_id, h, holder, now, {})
  end
  return OK
end

--[[
hw_admit  KEYS[1] = P:{pool}
          ARGV = want (stream slots asked for), cap (the bound: > 0 to set it, 0 for the
                 default from the lease rate), release (slots granted earlier and not
                 used: given back first)
The scheduler's fair queue asks before it dispatches: the pool's ready stream
holds at most `cap` entries not yet delivered to a worker (the `workers`
group's lag, which the stream itself keeps, so nothing can drift), counting
the slots granted and not yet published (P:{pool}:grants): several
schedulers together keep the bound, and a grant not published within
RESERVED_TTL_MS lapses (a dead scheduler's, however often the others ask).
The default cap is the workers' lease rate over READY_WINDOW_MS, within
[READY_MIN, READY_MAX]: a pool whose workers are slow or gone holds little,
and backs up only itself.
Reply: {granted, cap, undelivered, reserved} (integers).
]]
-- Entries of the pool's ready stream not yet delivered to the `workers` group.
local function undelivered(base)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', base .. ':ready')
  if not ok then
    return 0  -- no stream yet
  end
  for _, g in ipairs(groups) do
    local fields = {}
    for i = 1, #g, 2 do
      fields[g[i]] = g[i + 1]
    end
    if fields['name'] == 'workers' then
      local lag = tonumber(fields['lag'])
      if lag then
        return lag
      end
      return redis.call('XLEN', base .. ':ready')  -- lag unknown: count every entry
    end
  end
  return redis.call('XLEN', base .. ':ready')  -- no group yet: nothing delivered
end

--[[
hw_settled  KEYS[1] = P:{pool}
            ARGV = execution ids whose outcome Postgres has committed (the event
                   actor, after it applied their events)
A finished hash (done, dead, canceled) then lives SETTLED_TTL_MS more instead of
TERMINAL_TTL_MS: the sweeper no longer needs it (Postgres has the outcome, and its
republish is guarded by Postgres's state), so Redis holds finished attempts for
the seconds after their outcome is applied, not a minute of a drain's throughput.
Reply: how many were shortened.
]]
local function hw_settled(keys, args)
  local base = keys[1]
  local shortened = 0
  for i = 1, #args do
    local hot = base .. ':x:' .. args[i]
    local state = redis.call('HGET', hot, 'state')
    -- LT: only ever shorter (one command where PTTL and PEXPIRE were two an execution)
    if (state == 'done' or state == 'dead' or state == 'canceled')
        and redis.call('PEXPIRE', hot, SETTLED_TTL_MS, 'LT') == 1 then
      shortened = shortened + 1
    end
  end
  return shortened
end

local function hw_admit(keys, args)
  local base = keys[1]
  local want = int_arg('hw_admit', 'want', args[1])
  local cap = int_arg('hw_admit', 'cap', args[2] or '0')
  local release = int_arg('hw_admit', 'release', args[3] or '0')
  local grants = base .. ':grants'
  local now = now_ms()
  local reserved = give_back(grants, release, now)
  if cap <= 0 then
    local d = redis.call('HMGET', base .. ':drain', 'since_ms', 'rate')
    local rate = tonumber(d[2]) or 0
    if not tonumber(d[1]) or now - tonumber(d[1]) >= DRAIN_STALE_MS then
      rate = 0  -- nobody leased for a while: the workers may be gone
    end
    cap = math.min(READY_MAX, math.max(READY_MIN, math.floor(rate * READY_WINDOW_MS / 1000)))
  end
  local waiting = undelivered(base)
  local granted = math.max(0, math.min(want, cap - waiting - reserved))
  reserved = grant(grants, granted, reserved, now)
  return {granted, cap, waiting, reserved}
end

--[[
hw_take  KEYS[1] = P:{t.<tenant_id>}:bucket (the tenant's own slot: one bucket a tenant,
                   whichever pools its jobs use)
         ARGV = want, rate (tokens a second, > 0), burst (most tokens held, >= 1)
A token bucket: refills at `rate` up to `burst`, and gives up to `want` whole
tokens. Rate and burst come with each call, so a changed quota applies at
once. Reply: {granted, ms until the next whole token (0 if one is there)}.
hw_put   KEYS[1] = the bucket; ARGV = tokens, burst: gives back tokens taken and not used.
]]
local function bucket_now(key, rate, burst, now)
  local b = redis.call('HMGET', key, 'tokens', 'at_ms')
  local tokens, at = tonumber(b[1]), tonumber(b[2])
  if not tokens or not at then
    return burst
  end
  return math.min(burst, tokens + math.max(0, now - at) * rate / 1000)
end

local function bucket_save(key, tokens, rate, burst, now)
  redis.call('HSET', key, 'tokens', tostring(tokens), 'at_ms', fmt(now))
  -- once full again the bucket says nothing a fresh one would not
  redis.call('PEXPIRE', key, math.ceil(burst / rate * 1000) + 60000)
end

local function hw_take(keys, args)
  local want = int_arg('hw_take', 'want', args[1])
  local rate, burst = tonumber(args[2]), tonumber(args[3])
  if not rate or rate <= 0 or not burst or burst < 1 then
    bad_arg('hw_take', 'rate must be > 0 and burst >= 1')
  end
  local now = now_ms()
  local tokens = bucket_now(keys[1], rate, burst, now)
  local granted = math.max(0, math.min(want, math.floor(tokens)))
  tokens = tokens - granted
  bucket_save(keys[1], tokens, rate, burst, now)
  local wait = 0
  if tokens < 1 then
    wait = math.ceil((1 - tokens) * 1000 / rate)
  end
  return {granted, wait}
end

local function hw_put(keys, args)
  local n = int_arg('hw_put', 'tokens', args[1])
  local burst = tonumber(args[2])
  local b = redis.call('HMGET', keys[1], 'tokens', 'at_ms')
  if n > 0 and tonumber(b[1]) and burst then
    redis.call('HSET', keys[1], 'tokens', tostring(math.min(burst, tonumber(b[1]) + n)))
  end
  return n
end

--[[
Circuit breakers of HTTP targets, shared by every http worker. A target is
`scheme://host:port`; its breaker is the hash base..':cb:'..target (base =
P:{http}): state (closed | open | half), win (the window's start, ms), ok and
fail (outcomes counted in that window), opens (failed probes in a row),
open_until and probe_until (ms). A closed breaker with no failure keeps no key.

hw_breaker_check  KEYS[1] = P:{http}
                  ARGV = probe_ms (how long one probe may take), target, target...
May a delivery go to each target now? Per target: 0 (closed: go), -1 (go, as
the half-open breaker's one probe), or the ms to wait (open, or a probe is out).
]]
local function hw_breaker_check(keys, args)
  local base = keys[1]
  local probe_ms = int_arg('hw_breaker_check', 'probe_ms', args[1])
  local now = now_ms()
  local out = {}
  for i = 2, #args do
    local key = base .. ':cb:' .. args[i]
    local b = redis.call('HMGET', key, 'state', 'open_until', 'probe_until')
    local state = b[1]
    local reply = 0
    if state == 'open' and now < (tonumber(b[2]) or 0) then
      reply = tonumber(b[2]) - now
    elseif state == 'half' and now < (tonumber(b[3]) or 0) then
      reply = tonumber(b[3]) - now
    elseif state == 'open' or state == 'half' then  -- cooled down, or the probe was lost
      redis.call('HSET', key, 'state', 'half', 'probe_until', fmt(now + probe_ms))
      reply = -1
    end
    out[#out + 1] = reply
  end
  return out
end

--[[
hw_breaker_report  KEYS[1] = P:{http}
                   ARGV = threshold (failures that open it), window_ms, cooldown_ms
                          (the first open's), max_cooldown_ms, then per target four
                          values: target, successes, failures, probe ('1' when these are
                          the outcome of the probe hw_breaker_check granted)
A closed breaker opens when, within one window, failures reach threshold and
are at least as many as successes: one or two failures never open it. A
probe's success closes it; its failure opens it again for twice as long (up
to max_cooldown_ms). Outcomes of deliveries sent before it opened change
nothing while it is open. Reply per target: 0 closed, 1 open, 2 half-open.
]]
local BREAKER_STATE = {closed = 0, open = 1, half = 2}

local function hw_breaker_report(keys, args)
  local base = keys[1]
  local threshold = int_arg('hw_breaker_report', 'threshold', args[1])
  local window_ms = int_arg('hw_breaker_report', 'window_ms', args[2])
  local cooldown_ms = int_arg('hw_breaker_report', 'cooldown_ms', args[3])
  local max_cooldown_ms = int_arg('hw_breaker_report', 'max_cooldown_ms', args[4])
  local now = now_ms()
  local out = {}
  for i = 5, #args - 3, 4 do
    local key = base .. ':cb:' .. args[i]
    local ok_n = int_arg('hw_breaker_report', 'successes', args[i + 1])
    local fail_n = int_arg('hw_breaker_report', 'failures', args[i + 2])
    local probe = args[i + 3] == '1'
    local b = redis.call('HMGET', key, 'state', 'win', 'ok', 'fail', 'opens')
    local state = b[1] or 'closed'
    local function open(opens)
      local cool = math.min(max_cooldown_ms, cooldown_ms * 2 ^ opens)
      redis.call('HSET', key, 'state', 'open', 'opens', fmt(opens),
                 'open_until', fmt(now + cool), 'probe_until', '0')
      redis.call('PEXPIRE', key, max_cooldown_ms * 2 + window_ms)
      state = 'open'
    end
    if probe and state == 'half' then
      if fail_n > 0 then
        open((tonumber(b[5]) or 0) + 1)
      else
        redis.call('DEL', key)
        state = 'closed'
      end
    elseif state == 'closed' and (fail_n > 0 or b[1]) then
      local win, ok_c, fail_c = tonumber(b[2]), tonumber(b[3]) or 0, tonumber(b[4]) or 0
      if not win or now - win >= window_ms then
        win, ok_c, fail_c = now, 0, 0
      end
      ok_c, fail_c = ok_c + ok_n, fail_c + fail_n
      if fail_c >= threshold and fail_c >= ok_c then
        redis.call('HSET', key, 'win', fmt(win), 'ok', fmt(ok_c), 'fail', fmt(fail_c))
        open(0)
      elseif fail_c == 0 then
        redis.call('DEL', key)
      else
        redis.call('HSET', key, 'state', 'closed', 'win', fmt(win), 'ok', fmt(ok_c),
                   'fail', fmt(fail_c))
        redis.call('PEXPIRE', key, window_ms * 2)
      end
    end
    out[#out + 1] = BREAKER_STATE[state] or 0
  end
  return out
end

redis.register_function('hw_publish', hw_publish)
redis.register_function{function_name = 'hw_admit', callback = hw_admit}
redis.register_function{function_name = 'hw_settled', callback = hw_settled}
redis.register_function{function_name = 'hw_take', callback = hw_take}
redis.register_function{function_name = 'hw_put', callback = hw_put}
redis.register_function{function_name = 'hw_version', callback = hw_version,
                        flags = {'no-writes'}}
-- The rest write hot state and the events stream: default flags (may write,
-- refused when Redis is out of memory rather than half-applied).
redis.register_function{function_name = 'hw_lease', callback = hw_lease}
redis.register_function{function_name = 'hw_heartbeat', callback = hw_heartbeat}
redis.register_function{function_name = 'hw_complete', callback = hw_complete}
redis.register_function{function_name = 'hw_lease_batch', callback = hw_lease_batch}
redis.register_function{function_name = 'hw_complete_batch', callback = hw_complete_batch}
redis.register_function{function_name = 'hw_fail', callback = hw_fail}
redis.register_function{function_name = 'hw_recover', callback = hw_recover}
redis.register_function{function_name = 'hw_expire', callback = hw_expire}
redis.register_function{function_name = 'hw_cancel', callback = hw_cancel}
redis.register_function{function_name = 'hw_breaker_check', callback = hw_breaker_check}
redis.register_function{function_name = 'hw_breaker_report', callback = hw_breaker_report}
