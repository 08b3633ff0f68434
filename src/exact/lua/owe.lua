-- KEYS[1] = base key; ARGV = (unused), units, emission_us, tolerance_us.
-- A response's units charged after it to a `gcra` or `token_bucket` key (`cost: { response }`):
-- the units past what the decision reserved are owed (the theoretical arrival time moves on,
-- past the tolerance if need be: the key is in debt), or, used fewer, given back. Answers as the
-- deciding scripts do: {1, 0, 0, microseconds until the bucket is whole again}.
local units, emission = tonumber(ARGV[2]) or 0, tonumber(ARGV[3]) or 0
local tolerance = tonumber(ARGV[4]) or 0
local k = KEYS[1] .. ':tat'
local tat = tonumber(redis.call('GET', k) or '0')
if tat < now then tat = now end
-- A debt stops a year past the tolerance (as a proxy's own buckets do).
local most = math.max(tat, now + tolerance + 31536000000000)
tat = math.min(tat + units * emission, most)
if tat <= now then
  redis.call('DEL', k)
  return {1, 0, 0, 0}
end
redis.call('SET', k, string.format('%.3f', tat), 'PX', ms(tat - now))
return {1, 0, 0, math.ceil(tat - now)}
