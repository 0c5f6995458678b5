package amqp_test

import (
	"encoding/json"
	"math"
	"math/big"
	"strconv"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
)

// FuzzHeaderStrings feeds the adapter's header conversion (the AMQP header
// table of a delivery, as the consumer sees it in Message.Headers) tables
// built from fuzzed values of every type a table can hold, nested ones
// included. It must never panic, must keep every key, pass strings and
// byte arrays through unchanged, format numbers so that they parse back,
// decimals exactly, and render nested tables and arrays as valid JSON.
//
//	go test -run '^$' -fuzz '^FuzzHeaderStrings$' -fuzztime 30s ./brokers/amqp/
func FuzzHeaderStrings(f *testing.F) {
	f.Add("x-origin", "legacy", []byte("\xff\xfe"), int64(-42), 3.5, uint8(2), int32(12345), int64(0))
	f.Add("", "", []byte{}, int64(math.MinInt64), math.NaN(), uint8(255), int32(math.MinInt32), int64(math.MaxInt64))
	f.Add("traceparent", "zz-\x00-\xff", []byte("{\"a\":"), int64(math.MaxInt64), math.Inf(-1), uint8(0), int32(-1), int64(-1))
	f.Add("k\xc3\x28", "\u2028", []byte(nil), int64(0), math.Copysign(0, -1), uint8(18), int32(math.MaxInt32), int64(1e18))
	f.Fuzz(func(t *testing.T, key, s string, b []byte, i int64, fl float64, scale uint8, dec int32, unix int64) {
		ts := time.Unix(unix%(1<<35), 0)
		nested := amqp091.Table{"s": s, "b": b, "f": fl, "d": amqp091.Decimal{Scale: scale, Value: dec}, "t": ts,
			"deeper": amqp091.Table{key: []any{s, b, fl, nil}}}
		in := amqp091.Table{
			key + "-string": s, key + "-bytes": b, key + "-int64": i, key + "-int32": int32(i), key + "-int8": int8(i),
			key + "-uint8": uint8(i), key + "-float": fl, key + "-float32": float32(fl), key + "-bool": i%2 == 0,
			key + "-decimal": amqp091.Decimal{Scale: scale, Value: dec}, key + "-time": ts, key + "-void": nil,
			key + "-table": nested, key + "-array": []any{s, b, i, fl, nested, nil},
		}
		out := amqp.HeaderStrings(in)
		require.Len(t, out, len(in), "every key kept")
		require.Equal(t, s, out[key+"-string"])
		require.Equal(t, string(b), out[key+"-bytes"])
		require.Equal(t, strconv.FormatInt(i, 10), out[key+"-int64"])
		require.Equal(t, strconv.FormatInt(int64(int8(i)), 10), out[key+"-int8"])
		require.Equal(t, strconv.FormatBool(i%2 == 0), out[key+"-bool"])
		require.Equal(t, "", out[key+"-void"])
		got, err := strconv.ParseFloat(out[key+"-float"], 64)
		require.NoError(t, err, "a float header parses back: %q", out[key+"-float"])
		if !math.IsNaN(fl) {
			require.Equal(t, fl, got)
		}
		want := new(big.Rat).SetFrac(big.NewInt(int64(dec)), new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(scale)), nil))
		r, ok := new(big.Rat).SetString(out[key+"-decimal"])
		require.True(t, ok, "a decimal parses back: %q", out[key+"-decimal"])
		require.Zero(t, want.Cmp(r), "the decimal is exact: %q", out[key+"-decimal"])
		parsed, err := time.Parse(time.RFC3339, out[key+"-time"])
		require.NoError(t, err)
		require.True(t, parsed.Equal(ts), "the timestamp round-trips")
		for _, k := range []string{key + "-table", key + "-array"} {
			require.True(t, json.Valid([]byte(out[k])), "%s is valid JSON: %q", k, out[k])
		}
	})
}
