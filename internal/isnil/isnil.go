// Package isnil tells whether a value held in an interface is nil.
//
// A nil pointer stored in an interface makes the interface non-nil: a
// source, pool or publisher a failed constructor returned as a typed nil
// (a *kafka.Source from an Open whose error was dropped) passes a plain
// `== nil` check, and fails later, far from its cause, with a nil
// dereference. Constructors refuse it with this check instead.
package isnil

import "reflect"

// Value reports whether v is nil, or an interface holding a nil pointer,
// map, slice, channel, function or interface.
func Value(v any) bool {
	if v == nil {
		return true
	}
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Slice, reflect.Chan, reflect.Func, reflect.Interface, reflect.UnsafePointer:
		return rv.IsNil()
	}
	return false
}
