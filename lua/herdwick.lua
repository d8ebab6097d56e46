#!lua name=herdwick

--[[
herdwick's Redis functions: the only code that mutates hot state.

Every call takes one key, the pool's key base `P:{pool}` (P = key prefix; the
braces are a Redis Cluster hash tag, so every key derived from it lives in
the pool's slot). Derived keys:
  base..':ready'     stream of executions ready to lease (consumer group `workers`)
  base..':x:'..id    hash: hot state of execution `id` (attempt, state, ...)
Times are integer milliseconds of this server's clock.
]]

local LIBRARY_VERSION = '1'
local HOT_TTL_MS = 7 * 24 * 3600 * 1000
local PUBLISH_FIELDS = 10

--[[
hw_publish  KEYS[1] = P:{pool}
            ARGV = groups of 10, one per execution:
                   execution_id, attempt (decimal, from 1), job_id, tenant_id,
                   scheduled_for (RFC 3339 UTC), payload (JSON text),
                   timeout_seconds, idempotency_key, max_attempts, backoff_ms
                   (the last two stay in hot state, for hw_fail; not on the stream)
Writes each execution's hot state and XADDs it to P:{pool}:ready, unless
that attempt (or a later one) was published already: republishing is a
no-op, so a scheduler may retry a batch safely.
Returns the number of executions added to the stream.
]]
local function hw_publish(keys, args)
  local base = keys[1]
  local ready = base .. ':ready'
  local added = 0
  if #args % PUBLISH_FIELDS ~= 0 then
    return redis.error_reply('ERR hw_publish takes groups of 10 arguments')
  end
  for i = 1, #args, PUBLISH_FIELDS do
    local execution_id, attempt = args[i], args[i + 1]
    local hot = base .. ':x:' .. execution_id
    local current = tonumber(redis.call('HGET', hot, 'attempt') or '0')
    if current < tonumber(attempt) then
      redis.call('HSET', hot, 'attempt', attempt, 'state', 'ready', 'job_id', args[i + 2],
                 'tenant_id', args[i + 3], 'scheduled_for', args[i + 4],
                 'timeout_seconds', args[i + 6], 'max_attempts', args[i + 8],
                 'backoff_ms', args[i + 9])
      redis.call('PEXPIRE', hot, HOT_TTL_MS)
      redis.call('XADD', ready, '*',
                 'execution_id', execution_id, 'job_id', args[i + 2], 'tenant_id', args[i + 3],
                 'attempt', attempt, 'scheduled_for', args[i + 4], 'payload', args[i + 5],
                 'timeout_seconds', args[i + 6], 'idempotency_key', args[i + 7])
      added = added + 1
    end
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

redis.register_function('hw_publish', hw_publish)
redis.register_function{function_name = 'hw_version', callback = hw_version,
                        flags = {'no-writes'}}
