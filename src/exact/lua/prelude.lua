-- Shared by every Spillway script (prepended when the script is built).
-- Time is Redis's own (TIME, microseconds), never a proxy's clock, so proxies whose clocks
-- differ still share one timeline. Lua numbers are doubles: microseconds since the epoch
-- (~1.8e15) are exact below 2^53.
-- Every script returns {admitted (1|0), remaining, retry_us (-1 = never), reset_us}.
if redis.replicate_commands then pcall(redis.replicate_commands) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- Never nil, never below 1: a script must not fail whatever the cost argument holds.
local cost = math.max(1, math.floor(tonumber(ARGV[1]) or 1))
local function ms(us) return math.floor(us / 1000) + 1 end
local function id(n) return string.format('%.0f', n) end
