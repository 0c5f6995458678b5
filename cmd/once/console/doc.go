// Package console is the web console of once: an http.Handler a service
// can mount (or `once ui` serves) that shows consumers and their status,
// dead letters by consumer and kind with search, page by page, one
// record's headers and payload (its first 32 KiB, and a download of every
// byte), and, when Config.AllowReplay is set,
// replays one record or a selection of a page after a confirmation page;
// the replay redirects to its result, and a confirmation posted again
// shows its replay's outcome rather than replaying again.
//
// Pages are rendered on the server with html/template; there is no
// JavaScript and no build step. Links are relative, so the handler can be
// mounted under a prefix with http.StripPrefix. Replays are POST requests
// protected against cross-site request forgery (http.CrossOriginProtection);
// without AllowReplay the console is read-only and refuses them.
//
// The console has no authentication of its own: serve it on localhost
// (the default of once ui) or behind the service's own access control.
package console
