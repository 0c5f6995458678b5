package dlq_test

import (
	"testing"

	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }
