"""The board's Redis scripts: each one atomic step on the keys of one run, or of the tokens (one cluster slot).

Invariants: a script names only keys it is given (``KEYS``), all of one hash tag; the commit
script is the only writer of a version, and writes on every path that answers for a record
(``board/replica_ack.py`` relies on that for ``WAIT``).
"""

# Returns {code, head, committed_at_ms}: 0 committed, 1 identical record already
# committed, 2 different record exists, 3 head is not n-1, 4 unknown run. What a code
# means for the caller is decided in proto/commit.py (``outcome_of_store``).
# ARGV: version, record, now (ms), compact record, the commits channel, the run (published there).
COMMIT_LUA = """
local n = tonumber(ARGV[1])
if redis.call('EXISTS', KEYS[5]) == 0 then return {4, 0, 0} end
local head = tonumber(redis.call('HGET', KEYS[1], 'head') or '0')
local existing = redis.call('HGET', KEYS[2], ARGV[1])
if existing then
  if existing == ARGV[2] then
    redis.call('HSET', KEYS[1], 'seen_ms', ARGV[3])  -- a write, so a replica WAIT covers the record
    return {1, head, tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')}
  end
  return {2, head, 0}
end
if head ~= n - 1 then return {3, head, 0} end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[6], ARGV[1], ARGV[4])
redis.call('HSET', KEYS[1], 'head', ARGV[1], 'committed_at_ms', ARGV[3])
if not redis.call('HGET', KEYS[1], 'oldest') then
  redis.call('HSET', KEYS[1], 'oldest', ARGV[1])
end
redis.call('XADD', KEYS[3], ARGV[1] .. '-1', 'v', ARGV[1], 'r', ARGV[2], 't', ARGV[3])
redis.call('PUBLISH', ARGV[5], ARGV[6])  -- wakes every board process's feed of the run (a channel, not a key)
return {0, n, tonumber(ARGV[3])}
"""

# Moves oldest forward (never back) and trims commit events below it. Returns the new oldest.
ADVANCE_OLDEST_LUA = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'oldest') or '0')
local want = tonumber(ARGV[1])
if want > cur then
  redis.call('HSET', KEYS[1], 'oldest', ARGV[1])
  redis.call('XTRIM', KEYS[2], 'MINID', ARGV[1] .. '-1')
  return want
end
return cur
"""


# After version ARGV[1] committed: forgets the checks of the blobs it names (ARGV[2..]), then
# moves every other checked part of a version up to ARGV[1] to the orphans. Returns how many.
# Values are "<size>:<version>:<checked_ms>"; "<size>:<version>" (written before the check
# time was kept) reads the same here.
SETTLE_STAGED_LUA = """
for i = 2, #ARGV do
  redis.call('HDEL', KEYS[1], ARGV[i])
end
local version = tonumber(ARGV[1])
local checked = redis.call('HGETALL', KEYS[1])
local moved = 0
for i = 1, #checked, 2 do
  local value = checked[i + 1]
  local sep = string.find(value, ':', 1, true)
  local sep2 = sep and string.find(value, ':', sep + 1, true)
  local staged_for = sep and tonumber(string.sub(value, sep + 1, (sep2 or 0) - 1))
  if staged_for and staged_for <= version then
    redis.call('HSET', KEYS[2], checked[i], string.sub(value, 1, sep - 1))
    redis.call('HDEL', KEYS[1], checked[i])
    moved = moved + 1
  end
end
return moved
"""


# XADDs ARGV[2..] to the trajectory stream, trimming it to about ARGV[1] entries (0: no cap).
ADD_TRAJECTORIES_LUA = """
local maxlen = ARGV[1]
for i = 2, #ARGV do
  if maxlen == '0' then
    redis.call('XADD', KEYS[1], '*', 'r', ARGV[i])
  else
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', 'r', ARGV[i])
  end
end
return #ARGV - 1
"""


# Forget the islands whose lease ended before ARGV[1] (ms), atomically: a heartbeat that renews
# a lease between finding it stale and deleting it would otherwise be deleted with it.
# KEYS: islands (status), seen, leases. Returns how many were forgotten.
FORGET_ISLANDS_LUA = """
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[1])
for _, name in ipairs(stale) do
  redis.call('HDEL', KEYS[1], name)
  redis.call('HDEL', KEYS[2], name)
  redis.call('ZREM', KEYS[3], name)
end
return #stale
"""


# Stores a configured (bootstrap) admin token unless its id was retired for good (revoked
# through RevokeToken), stamped with the number of the start storing it; a larger stamp (a
# later start configures it too) stays. KEYS: the token's id hash, its hash key, the retired
# set. ARGV: token id, name, role, sha256 hex, start number. Returns 1 stored, 0 refused.
PUT_UNLESS_RETIRED_LUA = """
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then return 0 end
local start = redis.call('HGET', KEYS[1], 'start')
if not start or tonumber(start) < tonumber(ARGV[5]) then start = ARGV[5] end
redis.call('HSET', KEYS[1], 'name', ARGV[2], 'role', ARGV[3], 'hash', ARGV[4], 'start', start)
redis.call('SET', KEYS[2], ARGV[1])
return 1
"""


# Revokes a bootstrap token that a start does not configure, only if its stamp is older than
# that start's number (a token without a stamp, stored before stamps existed, is older than
# every start): a start never retires what a later start configured. KEYS: the token's id
# hash, its hash key. ARGV: start number, sha256 hex the caller read, token id. Returns 1
# revoked, 0 kept (a start at least as new configured it), -1 gone (or stored anew since read).
REVOKE_IF_OLDER_LUA = """
local record = redis.call('HMGET', KEYS[1], 'hash', 'start')
if not record[1] or record[1] ~= ARGV[2] then return -1 end
if tonumber(record[2] or '0') >= tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1])
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1
"""
