package amqp

// HeaderStrings exposes the header conversion to the external tests.
var HeaderStrings = headerStrings
