package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/internal/pgtest"
)

// once status -json on a database no consumer has written to printed
// "consumers": null, and with -dlq on an empty destination it left
// "dead_letters" out, though it named the destination: a script that
// iterates over either (jq '.consumers[]') failed on the empty case
// alone. Both are arrays, empty when there is nothing.
func TestStatusJSONOfNothingHasEmptyArrays(t *testing.T) {
	_, schema := pgtest.Schema(t)
	k := testenv.NewKafka(t)
	dlqName := testenv.Uniq("orders") + ".dlq"
	k.CreateTopic(dlqName, 1)
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema), "ONCE_KAFKA_BROKERS": strings.Join(k.Addrs, ",")}
	code, _, errOut := cli(t, env, "migrate")
	require.Equal(t, exitOK, code, errOut)

	code, out, errOut := cli(t, env, "status", "-json", "-dlq", dlqName)
	require.Equal(t, exitOK, code, errOut)
	var rep map[string]json.RawMessage
	require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
	assert.JSONEq(t, `[]`, string(rep["consumers"]), "consumers in %s", out)
	assert.JSONEq(t, `[]`, string(rep["dead_letters"]), "dead_letters in %s", out)

	// Without -dlq there are no dead letters to speak of.
	code, out, errOut = cli(t, env, "status", "-json")
	require.Equal(t, exitOK, code, errOut)
	rep = nil
	require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
	assert.JSONEq(t, `[]`, string(rep["consumers"]), out)
	assert.NotContains(t, rep, "dead_letters", out)
}

// On a database without the tables (the consumers never ran there, or
// -schema or -table names another place) status and retention failed
// with PostgreSQL's "relation does not exist", naming nothing that makes
// the tables. The error says once migrate does.
func TestCommandsOnADatabaseWithoutTheTablesNameMigrate(t *testing.T) {
	_, schema := pgtest.Schema(t)
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}
	for _, args := range [][]string{
		{"status"}, {"status", "-json"},
		{"retention", "-consumer", "billing", "-older-than", "720h"},
		{"retention", "-consumer", "billing", "-older-than", "720h", "-dry-run"},
	} {
		code, _, errOut := cli(t, env, args...)
		assert.Equal(t, exitFailure, code, "%v: %s", args, errOut)
		assert.Contains(t, errOut, "does not exist", args)
		assert.Contains(t, errOut, "once migrate creates the tables", args)
	}
	// Made, they are read.
	code, _, errOut := cli(t, env, "migrate")
	require.Equal(t, exitOK, code, errOut)
	code, _, errOut = cli(t, env, "status")
	assert.Equal(t, exitOK, code, errOut)
}
