-- KEYS[1] = base key; ARGV = cost, limit, window_us.
-- Cloudflare's estimate: the previous window's count weighted by how much of it still
-- overlaps the sliding window, plus the current window's count.
local limit, window = tonumber(ARGV[2]), tonumber(ARGV[3])
local idx = math.floor(now / window)
local elapsed = now - idx * window
local kc, kp = KEYS[1] .. ':swc:' .. id(idx), KEYS[1] .. ':swc:' .. id(idx - 1)
local cur = tonumber(redis.call('GET', kc) or '0')
local prev = tonumber(redis.call('GET', kp) or '0')
if cost > limit then return {0, 0, -1, window - elapsed} end
local used = prev * (window - elapsed) / window + cur
if used + cost > limit then
  -- Earliest offset e in this window with prev * (window - e) / window + cur + cost <= limit,
  -- else in the next one, where this window's count is the previous one.
  local retry = nil
  local room = limit - cur - cost
  if room >= 0 and prev > 0 then
    local e = math.ceil(window - room * window / prev)
    if e > elapsed and e < window then retry = e - elapsed end
  end
  if retry == nil then
    local e = 0
    if cur > 0 then e = math.max(0, math.ceil(window - (limit - cost) * window / cur)) end
    retry = window - elapsed + e
  end
  return {0, math.max(0, math.floor(limit - used)), retry, retry}
end
redis.call('INCRBY', kc, cost)
redis.call('PEXPIRE', kc, ms(2 * window - elapsed))
return {1, math.floor(limit - used - cost), 0, window - elapsed}
